"""The tutorial experiment on the fused kernels: Standard vs Full vs Block AttnRes.

50 Chinese→English sentence pairs (shipped with the package), a character
tokenizer and a decoder-only LM that reads ``zh <sep> en <eos>`` and is trained
on the English half. Default config: d=128, 6 layers, 4 heads, 3 blocks
(Block AttnRes with 2 layers per block), 300 epochs, AdamW 3e-3 with cosine
decay, batch 10.

    python -m attnres_kernels.demo [--epochs 300] [--out demo_out] [--backend auto] [--seed 0]

The models train in alternation, one epoch of each in turn, so that their
training times are measured over the same stretch of time and their ratio holds
on a busy machine. Prints the parameter counts, the loss every 50 epochs, the
first epoch reaching each loss threshold, each model's training time (the sum
of its epochs' wall times) and its ratio to Standard's, exact-match accuracy on
all 50 pairs and a few translations; writes ``loss_curves.png``, ``depth_attention.png`` and
``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from importlib import resources

import torch
import torch.nn.functional as F
from tqdm import tqdm

import attnres_kernels as ak

PAD, SEP, EOS = "<pad>", "<sep>", "<eos>"
LOSS_THRESHOLDS = (2.5, 2.0, 1.5, 1.0, 0.5, 0.3)
MODEL_NAMES = ("Standard", "Block", "Full")


def load_pairs() -> list:
    text = resources.files("attnres_kernels").joinpath("data/zh_en_pairs.tsv").read_text(encoding="utf-8")
    lines = [line.split("\t") for line in text.strip().splitlines()[1:]]
    return [(zh, en) for zh, en in lines]


class CharTokenizer:
    def __init__(self, texts):
        self.itos = [PAD, SEP, EOS] + sorted({c for t in texts for c in t})
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def encode(self, text: str) -> list:
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.itos[i] for i in ids if self.itos[i] not in (PAD, SEP, EOS))


def make_batch(pairs, tok: CharTokenizer):
    """Right-padded ``zh <sep> en <eos>`` sequences; targets are -100 except on the English half."""
    seqs, targets = [], []
    for zh, en in pairs:
        prompt = tok.encode(zh) + [tok.stoi[SEP]]
        answer = tok.encode(en) + [tok.stoi[EOS]]
        ids = prompt + answer
        seqs.append(ids[:-1])
        targets.append([-100] * (len(prompt) - 1) + answer)
    width = max(len(s) for s in seqs)
    x = torch.full((len(seqs), width), tok.stoi[PAD], dtype=torch.long)
    y = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, t) in enumerate(zip(seqs, targets)):
        x[i, : len(s)] = torch.tensor(s)
        y[i, : len(t)] = torch.tensor(t)
    return x, y


@torch.no_grad()
def greedy_translate(model, pairs, tok: CharTokenizer, max_new: int = 48) -> list:
    """Greedy decoding of all pairs in one right-padded batch: causal attention
    means the padding after a sequence never changes its last real position."""
    prompts = [tok.encode(zh) + [tok.stoi[SEP]] for zh, _ in pairs]
    lengths = torch.tensor([len(p) for p in prompts])
    buf = torch.full((len(prompts), int(lengths.max()) + max_new), tok.stoi[PAD], dtype=torch.long)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(p)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    rows = torch.arange(len(prompts))
    for _ in range(max_new):
        logits = model(buf[:, : int(lengths.max())])
        nxt = logits[rows, lengths - 1].argmax(-1)
        active = ~done
        buf[rows[active], lengths[active]] = nxt[active]
        lengths = lengths + active.long()
        done |= nxt == tok.stoi[EOS]
        if done.all():
            break
    outs = []
    for i, p in enumerate(prompts):
        gen = buf[i, len(p) : int(lengths[i])].tolist()
        if tok.stoi[EOS] in gen:
            gen = gen[: gen.index(tok.stoi[EOS])]
        outs.append(tok.decode(gen))
    return outs


def build_model(name: str, vocab: int, args) -> torch.nn.Module:
    common = dict(
        vocab_size=vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, backend=args.backend
    )
    if name == "Standard":
        return ak.nn.StandardTransformer(**common)
    if name == "Full":
        return ak.nn.FullAttnResTransformer(**common)
    return ak.nn.BlockAttnResTransformer(**common, layers_per_block=args.layers // args.blocks)


@dataclass
class RunResult:
    name: str
    params: int
    losses: list = field(default_factory=list)
    seconds: float = 0.0
    correct: int = 0
    translations: list = field(default_factory=list)


@dataclass
class Run:
    """One model in training: its optimizer, schedule, data order and results so far."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    order_gen: torch.Generator
    result: RunResult


def start_run(name: str, vocab: int, num_pairs: int, args) -> Run:
    torch.manual_seed(args.seed)
    model = build_model(name, vocab, args)
    # fused: one kernel for all parameters. The AttnRes models add two [d] vectors per
    # depth-attention site; the for-loop AdamW pays a fixed cost per parameter tensor.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    steps_per_epoch = math.ceil(num_pairs / args.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)
    result = RunResult(name, sum(p.numel() for p in model.parameters()))
    return Run(model, opt, sched, torch.Generator().manual_seed(args.seed), result)


def train_epoch(run: Run, pairs, tok, batch_size: int) -> None:
    """One epoch of ``run``'s model over all pairs in a fresh random order; appends the
    epoch's mean loss per target token and adds the epoch's wall time."""
    start = time.perf_counter()
    order = torch.randperm(len(pairs), generator=run.order_gen).tolist()
    total, count = 0.0, 0
    for b in range(0, len(pairs), batch_size):
        x, y = make_batch([pairs[i] for i in order[b : b + batch_size]], tok)
        logits = run.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        run.opt.step()
        run.sched.step()
        n_tokens = int((y != -100).sum())
        total, count = total + loss.item() * n_tokens, count + n_tokens
    run.result.seconds += time.perf_counter() - start
    run.result.losses.append(total / count)


def train_alternating(names, pairs, tok, args) -> dict:
    """Trains the models ``names`` in alternation, one epoch of each in turn (the turn order
    reversed every other epoch), so that load on a shared machine hits every model alike
    and their time ratios compare like with like. Returns ``{name: Run}``."""
    runs = {name: start_run(name, len(tok.itos), len(pairs), args) for name in names}
    bar = tqdm(range(args.epochs), desc="epochs", unit="ep", leave=True, dynamic_ncols=True, mininterval=0.5)
    for epoch in bar:
        for name in names if epoch % 2 == 0 else reversed(names):
            train_epoch(runs[name], pairs, tok, args.batch_size)
        bar.set_postfix_str(" ".join(f"{n} {r.result.losses[-1]:.4f}" for n, r in runs.items()))
    for run in runs.values():
        run.model.eval()
        run.result.translations = greedy_translate(run.model, pairs, tok)
        run.result.correct = sum(t == en for t, (_, en) in zip(run.result.translations, pairs))
    return runs


def mean_depth_weights(model, pairs, tok) -> torch.Tensor:
    """[sites, max sources] mean depth-attention weight over all real target
    positions of the 50 pairs (NaN where a site has fewer sources)."""
    x, y = make_batch(pairs, tok)
    with torch.no_grad():
        _, weights = model(x, return_depth_weights=True)
    mask = (x != tok.stoi[PAD]).float()
    table = torch.full((len(weights), max(w.shape[0] for w in weights)), float("nan"))
    for k, w in enumerate(weights):
        table[k, : w.shape[0]] = (w * mask).sum((1, 2)) / mask.sum()
    return table


def format_table(headers, rows) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def report(results: dict, pairs, epochs: int) -> str:
    base = results.get("Standard")
    out = []
    rows = [[r.name, f"{r.params:,}", f"{r.params - base.params:+,}" if base else "-"] for r in results.values()]
    out += ["Parameters", format_table(["model", "params", "vs Standard"], rows), ""]
    marks = sorted({e for e in range(49, epochs, 50)} | {epochs - 1})
    rows = [[f"{e + 1}"] + [f"{r.losses[e]:.4f}" for r in results.values()] for e in marks]
    out += ["Training loss (mean over the epoch)", format_table(["epoch", *results], rows), ""]
    rows = []
    for t in LOSS_THRESHOLDS:
        firsts = [next((i + 1 for i, loss in enumerate(r.losses) if loss <= t), None) for r in results.values()]
        rows.append([f"<= {t}"] + [str(f) if f else "-" for f in firsts])
    out += ["First epoch reaching the loss", format_table(["loss", *results], rows), ""]
    rows = [
        [
            r.name,
            f"{r.seconds:.1f}",
            f"{r.seconds / base.seconds:.2f}x" if base else "-",
            f"{r.correct}/{len(pairs)}",
            f"{r.losses[-1]:.4f}",
        ]
        for r in results.values()
    ]
    out += [
        "Time and accuracy (the models train in alternation, one epoch of each in turn; train s: the sum of a "
        "model's epoch wall times)",
        format_table(["model", "train s", "vs Standard", "exact match", "final loss"], rows),
        "",
    ]
    rows = []
    for k in range(0, len(pairs), max(1, len(pairs) // 6))[:6]:
        rows.append([pairs[k][0], pairs[k][1]] + [r.translations[k] for r in results.values()])
    out += ["Example translations", format_table(["zh", "reference", *results], rows)]
    return "\n".join(out)


def plot(results: dict, heatmaps: dict, out_dir: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results.values():
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=f"{r.name} ({r.correct}/50)")
    ax.set(xlabel="epoch", ylabel="training loss", yscale="log", title="AttnRes demo: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "loss_curves.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if heatmaps:
        fig, axes = plt.subplots(1, len(heatmaps), figsize=(5.5 * len(heatmaps), 5), squeeze=False)
        for ax, (name, table) in zip(axes[0], heatmaps.items()):
            im = ax.imshow(table.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
            ax.set(
                title=f"{name} AttnRes: mean depth weight",
                xlabel="source (0 = embedding / block 0)",
                ylabel="site (attn, mlp per layer; last = output)",
                xticks=range(table.shape[1]),
                yticks=range(table.shape[0]),
            )
            fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "depth_attention.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def run(argv=None) -> dict:
    """Runs the demo with command-line arguments ``argv``; prints the tables and
    returns the results (also written to ``results.json``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--out", default="demo_out", help="directory for the plots and results.json")
    parser.add_argument("--backend", default="auto", choices=ak.BACKENDS, help="depth-attention backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=3, help="Block AttnRes blocks (layers must divide evenly)")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    if args.layers % args.blocks:
        parser.error(f"--layers {args.layers} is not divisible by --blocks {args.blocks}")
    os.makedirs(args.out, exist_ok=True)
    pairs = load_pairs()
    tok = CharTokenizer([t for pair in pairs for t in pair])
    backend = ak.ops.resolve_backend(args.backend, torch.device("cpu"), args.d_model)
    print(
        f"{len(pairs)} pairs, vocab {len(tok.itos)}, d={args.d_model}, L={args.layers}, heads={args.heads}, "
        f"blocks={args.blocks}, epochs={args.epochs}, depth-attention backend: {backend} ({ak.build_info()}), "
        f"torch threads: {torch.get_num_threads()}"
    )
    names = [m for m in MODEL_NAMES if m in args.models]
    runs = train_alternating(names, pairs, tok, args)
    results = {name: run.result for name, run in runs.items()}
    heatmaps = {name: mean_depth_weights(run.model, pairs, tok) for name, run in runs.items() if name != "Standard"}
    text = report(results, pairs, args.epochs)
    print("\n" + text)
    paths = plot(results, heatmaps, args.out)
    summary = {
        "config": vars(args) | {"resolved_backend": backend, "threads": torch.get_num_threads()},
        "models": {
            n: {
                "params": r.params,
                "losses": r.losses,
                "train_seconds": r.seconds,
                "exact_match": r.correct,
                "translations": r.translations,
            }
            for n, r in results.items()
        },
        "depth_weights": {
            n: [[None if math.isnan(v) else v for v in row] for row in t.tolist()] for n, t in heatmaps.items()
        },
    }
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, ensure_ascii=False, indent=1)
    print(f"\nwrote {', '.join(paths + [os.path.join(args.out, 'results.json')])}")
    return summary


def main(argv=None) -> int:
    """Entry point of ``python -m attnres_kernels.demo`` and the ``attnres-demo`` script: exit status 0."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
