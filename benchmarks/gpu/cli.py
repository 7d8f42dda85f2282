"""The command line: runs the sections asked for and writes the report after each one."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

import torch

from .environment import ROOT, Env, describe_environment
from .host import bench_host
from .inkling2 import bench_inkling2_model, bench_inkling2_reads
from .models import bench_models, model_config
from .ops import bench_attention, bench_block_step
from .reads import IMPLS, bench_case, read_cases
from .report import markdown


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    return obj


SECTIONS = ["reads", "attention", "block_step", "host", "models", "inkling2_reads", "inkling2_step"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description=sys.modules[__package__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU run of the same code (no GPU needed)")
    parser.add_argument("--out", default=None, help="directory for gpu.md / gpu.json (default: benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="three depth-read cases instead of the full sweep")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time per measurement, ms")
    parser.add_argument("--skip-models", action="store_true", help="skip the model training-step benchmark")
    parser.add_argument("--model-batch", type=int, default=4)
    parser.add_argument(
        "--sections", nargs="*", choices=SECTIONS, default=SECTIONS, help="the report's sections to measure (all)"
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only these depth-read implementations (names as listed)"
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to exercise the script on CPU", file=sys.stderr)
        return 2
    env = Env(
        device=torch.device("cpu" if args.dry_run else "cuda"),
        dry_run=args.dry_run,
        rep_ms=args.rep,
        compile_backend="aot_eager" if args.dry_run else "inductor",
    )
    impls = [i for i in IMPLS if args.only is None or i.name in args.only]
    env_info = describe_environment(env)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda x, **_: x
    read_rows, copies = {}, {}
    attention_rows, block_step_rows, model_rows, inkling2_rows, host_rows = {}, {}, [], [], []
    cfg = None if args.skip_models else model_config(args.dry_run, args.model_batch)
    inkling2_step = None
    out_dir = (
        args.out if args.out is not None else (None if args.dry_run else os.path.join(ROOT, "benchmarks", "results"))
    )

    def write_report() -> str:
        """The report of the sections measured so far, written after each one (a run cut short keeps them)."""
        report = markdown(
            env_info,
            read_rows,
            copies,
            model_rows,
            cfg,
            inkling2_rows,
            inkling2_step,
            attention_rows,
            block_step_rows,
            host_rows,
        )
        if out_dir is None:
            return report
        result = {
            "environment": env_info,
            "depth_read": {case: [asdict(r) for r in rows] for case, rows in read_rows.items()},
            "copy_gbps": copies,
            "attention": {case: [asdict(r) for r in rows] for case, rows in attention_rows.items()},
            "block_step": {case: [asdict(r) for r in rows] for case, rows in block_step_rows.items()},
            "host": [asdict(r) for r in host_rows],
            "models": {"config": asdict(cfg) if cfg else None, "rows": [asdict(r) for r in model_rows]},
            "inkling2_reads": [asdict(r) for r in inkling2_rows],
            "inkling2_step": None
            if inkling2_step is None
            else {"model": vars(inkling2_step[0]), "rows": [asdict(r) for r in inkling2_step[1]]},
        }
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gpu.md"), "w") as f:
            f.write(report)
        with open(os.path.join(out_dir, "gpu.json"), "w") as f:
            json.dump(_jsonable(result), f, indent=1)
        return report

    if "reads" in args.sections:
        for case in tqdm(read_cases(args.dry_run, args.quick), desc="depth read"):
            read_rows[case.label], copies[case.label] = bench_case(case, env, impls)
            write_report()
    if "attention" in args.sections:
        attention_rows.update(bench_attention(env))
        write_report()
    if "block_step" in args.sections:
        block_step_rows.update(bench_block_step(env))
        write_report()
    if "host" in args.sections:
        host_rows += bench_host(env)
        write_report()
    if cfg is not None and "models" in args.sections:
        model_rows += bench_models(cfg, env)
        write_report()
    if "inkling2_reads" in args.sections:
        inkling2_rows += bench_inkling2_reads(env)
        write_report()
    if not args.skip_models and "inkling2_step" in args.sections:
        inkling2_step = bench_inkling2_model(env)
    report = write_report()
    if out_dir is None:
        print(report)
        return 0
    print(report)
    print(f"wrote {os.path.join(out_dir, 'gpu.md')} and gpu.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
