"""Model-level measurements of the ``attnres_kernels.nn`` models: train-step time per
schedule, activation memory with and without checkpointing, and ``torch.compile``.

    python benchmarks/model_steps.py steps   [--config demo|d256] [--models ...] [--rounds 30] [--threads N]
    python benchmarks/model_steps.py memory  [--config d256]
    python benchmarks/model_steps.py compile [--config demo] [--rounds 20]

Configs: ``demo`` is the demo's (d=128, L=6, 4 heads, 3 blocks, one batch of 10
pairs of the demo data); ``d256`` is d=256, L=12, 4 heads, 3 blocks, B=4, T=128
(random tokens, vocab 64). A model is named ``Standard``, ``Full:C`` (chunk
size C) or ``Block:two_phase`` / ``Block:per_site``; ``--backend`` picks the
depth-read backend, ``--attention`` the attention's (default ``sdpa``: PyTorch's
attention, so that the depth reads are what differs between models).

``steps`` times one AdamW step (forward, backward, optimizer) of every model,
round-robin (one step of each model per round, so load on the shared machine
hits all models alike), and prints the median, quartiles and the ratio of
medians to Standard. ``memory`` prints the bytes autograd saves for backward
(distinct storages) and the peak-RSS growth of one forward+backward, without
and with ``checkpoint=True``. ``compile`` compares eager and
``torch.compile(model, fullgraph=True)`` (Inductor): compile time of the first
step and the step times after it.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py
import attnres_kernels as ak
from attnres_kernels.demo import CharTokenizer, load_pairs, make_batch

from common import saved_activation_bytes

CONFIGS = {
    "demo": dict(d_model=128, n_layers=6, n_heads=4, layers_per_block=2),
    "d256": dict(d_model=256, n_layers=12, n_heads=4, layers_per_block=4),
}
DEFAULT_MODELS = ["Standard", "Full:1", "Full:2", "Full:4", "Full:6", "Block:per_site", "Block:two_phase"]


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


def build(name: str, config: str, vocab: int, backend: str, attention: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = dict(CONFIGS[config])
    per_block = cfg.pop("layers_per_block")
    common = dict(vocab_size=vocab, backend=backend, attention_backend=attention, **cfg, **extra)
    kind, _, option = name.partition(":")
    if kind == "Standard":
        return ak.nn.StandardTransformer(**common)
    if kind == "Full":
        return ak.nn.FullAttnResTransformer(**common, chunk_size=int(option or ak.nn.DEFAULT_CHUNK_SIZE))
    return ak.nn.BlockAttnResTransformer(**common, layers_per_block=per_block, schedule=option or "two_phase")


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
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
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
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        steps[name] = lambda model=model, opt=opt: train_step(model, opt, x, y)
    print_times(time_round_robin(steps, args.rounds), args.models[0])


def peak_rss_growth(fn) -> int:
    """Growth of the process's peak RSS (bytes) while running ``fn``: a lower bound of
    its peak memory, 0 when it stays below an earlier peak (run the larger case last)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def cmd_memory(args) -> None:
    vocab, x, y = batch(args.config)
    print("| model | saved for backward (MiB) | with checkpoint=True (MiB) | ratio |")
    print("|---|---|---|---|")
    for name in args.models:
        row = []
        for ckpt in (False, True):
            model = build(name, args.config, vocab, args.backend, args.attention, checkpoint=ckpt)
            row.append(saved_activation_bytes(lambda model=model: loss_of(model, x, y)))
        print(f"| {name} | {row[0] / 2**20:.2f} | {row[1] / 2**20:.2f} | {row[1] / row[0]:.3f} |")


def cmd_compile(args) -> None:
    vocab, x, y = batch(args.config)
    steps = {}
    print("| model | first compiled step (s) |")
    print("|---|---|")
    for name in args.models:
        for compiled in (False, True):
            model = build(name, args.config, vocab, args.backend, args.attention)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
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
    parser.add_argument("command", choices=("steps", "memory", "compile"))
    parser.add_argument("--config", choices=tuple(CONFIGS), default="demo")
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--backend", default="auto", choices=ak.BACKENDS)
    parser.add_argument("--attention", default="sdpa", help="attention backend of the models (default sdpa)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.models = args.models or (
        DEFAULT_MODELS if args.command == "steps" else ["Standard", "Full", "Block:per_site", "Block:two_phase"]
    )
    print(
        f"# {args.command}, config {args.config} {CONFIGS[args.config]}, depth backend {args.backend}, "
        f"attention {args.attention}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    {"steps": cmd_steps, "memory": cmd_memory, "compile": cmd_compile}[args.command](args)


if __name__ == "__main__":
    main()
