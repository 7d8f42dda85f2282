"""Decode speed of the ``attnres_kernels.nn`` models on CPU: greedy generation with the
decode cache (``model.generate``: one prefill of the prompt, then one token per
forward) against a loop without a cache that re-runs the full forward over the
growing sequence.

    python benchmarks/decode.py [--attention auto sdpa] [--batch-sizes 1 4] [--prompt 32] [--new 64] [--repeats 5]

Config: d=128, L=6, 4 heads, vocab 256 (the demo's model size), Block with 2
layers per block; random prompts, default initialization (speed does not depend
on the weights). ``--backend`` is the depth-read backend, ``--attention`` the
attention backends to compare (default ``auto``, the C++ kernels on CPU, and
``sdpa``, PyTorch's). A model is ``Standard``,
``Full:C`` (chunk size C) or ``Block:per_site`` / ``Block:two_phase``.

Tokens/s counts the new tokens of all sequences (``B * new``) over the whole
generation, prefill included. Every (model, B, mode) runs once per round,
round-robin (its attention backends one after the other, every other round in
reverse order), so load on the shared machine hits all alike; the table gives the
median over the rounds and, in brackets, the slowest and fastest; with several
attention backends a second table gives each one's tokens/s over the last one's
(``sdpa`` by default) round by round, the load average beside both. With 1 thread
(default) a run is timed by the CPU time of the thread (``time.thread_time``),
which waiting for a core does not inflate; ``--threads N`` (N > 1) times wall
clock. Both modes must produce the same tokens (checked once per case). The
Markdown table is printed and written to ``benchmarks/results/decode.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py
import attnres_kernels as ak

from common import report_header

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None

CONFIG = dict(vocab_size=256, d_model=128, n_layers=6, n_heads=4)
LAYERS_PER_BLOCK = 2
DEFAULT_MODELS = ["Standard", "Full:1", "Full:4", "Block:per_site", "Block:two_phase"]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "decode.md")


def build(name: str, backend: str, attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(CONFIG, backend=backend, attention_backend=attention)
    kind, _, option = name.partition(":")
    if kind == "Standard":
        model = ak.nn.StandardTransformer(**common)
    elif kind == "Full":
        model = ak.nn.FullAttnResTransformer(**common, chunk_size=int(option or ak.nn.DEFAULT_CHUNK_SIZE))
    else:
        model = ak.nn.BlockAttnResTransformer(
            **common, layers_per_block=LAYERS_PER_BLOCK, schedule=option or ak.nn.DEFAULT_BLOCK_SCHEDULE
        )
    return model.eval()


def generate_without_cache(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding that re-runs the full forward over the growing sequence."""
    seq = prompt
    for _ in range(new):
        next_token = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, next_token], dim=1)
    return seq


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--prompt", type=int, default=32, help="prompt length")
    parser.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (after one warmup round)")
    parser.add_argument("--backend", default="auto", choices=ak.BACKENDS)
    parser.add_argument("--attention", nargs="+", default=["auto", "sdpa"], help="attention backends of the models")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: thread CPU time)")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    header = report_header("Decode speed", argv)

    models = {(name, att): build(name, args.backend, att) for att in args.attention for name in args.models}
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, CONFIG["vocab_size"], (b, args.prompt), generator=gen) for b in args.batch_sizes}
    # The attention backends of one (model, B, mode) run next to each other, so that the paired ratios below
    # compare runs on the same state of the caches and the machine; every other round runs the list backwards.
    decoders = {
        "cache": lambda m, p: m.generate(p, args.new),
        "no cache": lambda m, p: generate_without_cache(m, p, args.new),
    }
    runs = {}
    for name in args.models:
        for b, prompt in prompts.items():
            for mode, decode in decoders.items():
                for att in args.attention:
                    runs[((name, att), b, mode)] = lambda m=models[(name, att)], p=prompt, decode=decode: decode(m, p)

    times = {key: [] for key in runs}
    load_before = os.getloadavg()
    rounds = range(args.repeats + 1)
    with torch.no_grad():
        for case in models:  # both modes must decode the same tokens
            for b in prompts:
                cached, uncached = runs[(case, b, "cache")](), runs[(case, b, "no cache")]()
                if not torch.equal(cached, uncached):
                    raise AssertionError(f"{case}, B={b}: the cached decode differs from the loop without cache")
        for r in tqdm(rounds, desc="rounds") if tqdm is not None else rounds:
            for key, fn in list(runs.items())[:: 1 if r % 2 == 0 else -1]:
                start = clock()
                fn()
                if r > 0:  # round 0 warms up
                    times[key].append(clock() - start)

    def tokens_per_s(key):
        rates = [key[1] * args.new / t for t in times[key]]
        return statistics.median(rates), min(rates), max(rates)

    lines = [
        f"Greedy decoding on CPU: d={CONFIG['d_model']}, L={CONFIG['n_layers']}, {CONFIG['n_heads']} heads, "
        f"vocab {CONFIG['vocab_size']}, Block {LAYERS_PER_BLOCK} layers per block; prompt {args.prompt}, "
        f"{args.new} new tokens; depth-read backend {args.backend!r}, "
        f"{args.threads} thread(s); median [min, max] of {args.repeats} rounds; tokens/s = B x new tokens / "
        f"total time incl. prefill. Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "",
        "| model | attention | B | with cache (tok/s) | without cache (tok/s) | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for case in models:
        name, attention = case
        for b in prompts:
            cached, uncached = tokens_per_s((case, b, "cache")), tokens_per_s((case, b, "no cache"))
            lines.append(
                f"| {name} | {attention} | {b} | {cached[0]:.0f} [{cached[1]:.0f}, {cached[2]:.0f}] | "
                f"{uncached[0]:.0f} [{uncached[1]:.0f}, {uncached[2]:.0f}] | {cached[0] / uncached[0]:.2f}x |"
            )
    attentions = list(dict.fromkeys(att for _, att in models))
    if len(attentions) > 1:  # each backend against the last one, round by round (the same load hit both)
        last = attentions[-1]
        lines += [
            "",
            f"Paired: tokens/s of each attention backend / tokens/s of {last!r} in the same round (median [min, max] "
            "over the rounds; > 1: faster).",
            "",
            "| model | attention | B | with cache | without cache |",
            "|---|---|---|---|---|",
        ]
        for att in attentions[:-1]:
            for name in args.models:
                for b in prompts:
                    cells = []
                    for mode in ("cache", "no cache"):
                        ratios = [
                            base / mine
                            for mine, base in zip(times[((name, att), b, mode)], times[((name, last), b, mode)])
                        ]
                        cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
                    lines.append(f"| {name} | {att} | {b} | {cells[0]} | {cells[1]} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(f"{header}\n{table}\n")


if __name__ == "__main__":
    main()
