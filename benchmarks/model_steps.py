"""Model-level measurements of the ``attnres_kernels.nn`` models: train-step time per
schedule, activation memory with and without checkpointing, and ``torch.compile``.

    python benchmarks/model_steps.py steps   [--config demo|d256] [--models ...] [--rounds 30] [--threads N]
    python benchmarks/model_steps.py memory  [--config d256]
    python benchmarks/model_steps.py compile [--config demo] [--rounds 20]

``--out FILE`` appends the output as a section (with the command, commit, date and
device) to a Markdown report, created when missing.

Configs: ``demo`` is the demo's (d=128, L=6, 4 heads, 3 blocks, one batch of 10
pairs of the demo data); ``d256`` is d=256, L=12, 4 heads, 3 blocks, B=4, T=128
(random tokens, vocab 64). A model is named ``Standard``, ``Full:C`` (chunk
size C) or ``Block:two_phase`` / ``Block:per_site``; ``--backend`` picks the
depth-read backend, ``--attention`` the attention's (default ``sdpa``: PyTorch's
attention, so that the depth reads are what differs between models).

``steps`` times one AdamW step (forward, backward, fused optimizer) of every model,
round-robin (one step of each model per round, so load on the shared machine
hits all models alike), and prints the median, quartiles and the ratio of
medians to the first model. By default torch runs 1 thread and a step is timed
by the CPU time of that thread (``time.thread_time``), which waiting for a core
on a loaded machine does not inflate; ``--threads N`` (N > 1) times wall clock.
``memory`` prints, without and with ``checkpoint=True``, the bytes autograd
saves for backward (distinct storages, seen by a ``saved_tensors_hooks``: with
checkpointing only what is saved outside the recomputed layers) and the growth
of the process's resident memory over the forward (what the forward leaves
alive for backward, measured in a fresh process with glibc returning every
allocation above 128 KiB to the system when freed). ``compile`` compares eager and
``torch.compile(model, fullgraph=True)`` (Inductor): compile time of the first
step and the step times after it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py
import attnres_kernels as ak
from attnres_kernels.demo import CharTokenizer, load_pairs, make_batch

from common import report_header, saved_activation_bytes

CONFIGS = {
    "demo": dict(d_model=128, n_layers=6, n_heads=4, layers_per_block=2),
    "d256": dict(d_model=256, n_layers=12, n_heads=4, layers_per_block=4),
}
DEFAULT_MODELS = ["Standard", "Full:1", "Full:2", "Full:4", "Full:6", "Block:per_site", "Block:two_phase"]
# The title of a report the commands append their sections to (benchmarks/results/models.md).
REPORT_COMMANDS = "`benchmarks/model_steps.py` steps, memory and compile, one section each"


def batch(config: str):
    """``(vocab, x, y)`` of one training batch of the config."""
    if config == "demo":
        pairs = load_pairs()
        tok = CharTokenizer([t for pair in pairs for t in pair])
        x, y = make_batch(pairs[:10], tok)
        return len(tok.itos), x, y
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (4, 128), generator=gen)
    return 64, x, torch.roll(x, -1, dims=1)


def build(name: str, config: str | dict, vocab: int, backend: str, attention: str, **extra) -> torch.nn.Module:
    """Model ``name`` of ``config`` (a name in ``CONFIGS`` or such a dict of model sizes)."""
    torch.manual_seed(0)
    cfg = dict(CONFIGS[config] if isinstance(config, str) else config)
    per_block = cfg.pop("layers_per_block")
    common = dict(vocab_size=vocab, backend=backend, attention_backend=attention, **cfg, **extra)
    kind, _, option = name.partition(":")
    if kind == "Standard":
        return ak.nn.StandardTransformer(**common)
    if kind == "Full":
        return ak.nn.FullAttnResTransformer(**common, chunk_size=int(option or ak.nn.DEFAULT_CHUNK_SIZE))
    return ak.nn.BlockAttnResTransformer(
        **common, layers_per_block=per_block, schedule=option or ak.nn.DEFAULT_BLOCK_SCHEDULE
    )


def loss_of(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)


def train_step(model, opt, x, y):
    loss = loss_of(model, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def time_round_robin(steps: dict, rounds: int, warmup: int = 3) -> dict:
    """Seconds of every call of each ``steps[name]()``, one call of each per round."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def print_times(times: dict, base: str) -> None:
    base_median = statistics.median(times[base])
    print(f"| model | median ms | q1 ms | q3 ms | vs {base} |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        q1, med, q3 = statistics.quantiles(ts, n=4)
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.2f} | {q1 * 1e3:.2f} | {q3 * 1e3:.2f} | {med / base_median:.3f}x |")


def cmd_steps(args) -> None:
    vocab, x, y = batch(args.config)
    models = {name: build(name, args.config, vocab, args.backend, args.attention) for name in args.models}
    steps = {}
    for name, model in models.items():
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        steps[name] = lambda model=model, opt=opt: train_step(model, opt, x, y)
    print_times(time_round_robin(steps, args.rounds), args.models[0])


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cmd_rss(args) -> None:
    """(Child process of ``memory``.) Prints the resident-memory growth over one forward."""
    vocab, x, y = batch(args.config)
    model = build(args.models[0], args.config, vocab, args.backend, args.attention, checkpoint=args.checkpoint)
    loss_of(model, x, y).backward()  # first step: gradients and lazily built state exist from here on
    model.zero_grad(set_to_none=False)
    before = resident_bytes()
    loss = loss_of(model, x, y)
    print(resident_bytes() - before)
    loss.backward()


def cmd_memory(args) -> None:
    vocab, x, y = batch(args.config)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    print("| model | saved for backward (MiB) | with ckpt (MiB) | forward RSS growth (MiB) | with ckpt (MiB) |")
    print("|---|---|---|---|---|")
    for name in args.models:
        saved, rss = [], []
        for ckpt in (False, True):
            model = build(name, args.config, vocab, args.backend, args.attention, checkpoint=ckpt)
            saved.append(saved_activation_bytes(lambda model=model: loss_of(model, x, y)) / 2**20)
            child = [sys.executable, os.path.abspath(__file__), "rss", "--config", args.config, "--models", name]
            child += ["--backend", args.backend, "--attention", args.attention] + (["--checkpoint"] if ckpt else [])
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
            rss.append(int(out.strip().splitlines()[-1]) / 2**20)
        print(f"| {name} | {saved[0]:.2f} | {saved[1]:.2f} | {rss[0]:.2f} | {rss[1]:.2f} |")


def cmd_compile(args) -> None:
    vocab, x, y = batch(args.config)
    steps = {}
    print("| model | first compiled step (s) |")
    print("|---|---|")
    for name in args.models:
        for compiled in (False, True):
            model = build(name, args.config, vocab, args.backend, args.attention)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
            run = torch.compile(model, fullgraph=True) if compiled else model
            fn = lambda run=run, opt=opt: train_step(run, opt, x, y)
            if compiled:
                start = time.perf_counter()
                fn()
                print(f"| {name} | {time.perf_counter() - start:.1f} |")
            steps[f"{name} {'compiled' if compiled else 'eager'}"] = fn
    print()
    print_times(time_round_robin(steps, args.rounds), next(iter(steps)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("steps", "memory", "compile", "rss"))
    parser.add_argument("--config", choices=tuple(CONFIGS), default="demo")
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--backend", default="auto", choices=ak.BACKENDS)
    parser.add_argument("--attention", default="sdpa", help="attention backend of the models (default sdpa)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--checkpoint", action="store_true", help="(rss) build the model with checkpoint=True")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: thread CPU time)")
    parser.add_argument("--out", help="also append the output as a section of this Markdown report")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.models = args.models or (
        DEFAULT_MODELS if args.command == "steps" else ["Standard", "Full", "Block:per_site", "Block:two_phase"]
    )
    if args.command == "rss":
        return cmd_rss(args)
    header = report_header(f"{args.command}, config {args.config}", argv).replace("# ", "## ", 1)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        print(
            f"Config {args.config}: {CONFIGS[args.config]}, depth backend {args.backend}, attention "
            f"{args.attention}, {torch.get_num_threads()} torch threads, clock: "
            f"{'thread CPU time' if torch.get_num_threads() == 1 else 'wall'}.\n"
        )
        {"steps": cmd_steps, "memory": cmd_memory, "compile": cmd_compile}[args.command](args)
    print(output.getvalue(), end="")
    if args.out:
        new_report = not os.path.exists(args.out)
        with open(args.out, "a", encoding="utf-8") as f:
            if new_report:
                f.write(f"# Model-level measurements ({REPORT_COMMANDS})\n\n")
            f.write(f"{header}\n{output.getvalue()}\n")


if __name__ == "__main__":
    main()
