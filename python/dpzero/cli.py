"""The ``dpzero`` command line: ``dpzero budget``, ``dpzero calibrate``, ``dpzero train``,
``dpzero plan`` and ``dpzero report``.

argparse (standard library) parses; the numbers come from the C++ accountants.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import List, Optional, Sequence

from . import _C
from .accounting import ACCOUNTANTS, LedgerError, get_noise_multiplier, get_steps
from .budget import epsilon_curve, evaluate, plot_epsilon_curve


def _accountant_list(text: str) -> List[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in ACCOUNTANTS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"--accountant takes a comma-separated subset of {','.join(ACCOUNTANTS)}, got {text!r}")
    return names


def _steps_from(args: argparse.Namespace) -> int:
    if (args.steps is None) == (args.epochs is None):
        raise ValueError("give exactly one of --steps and --epochs")
    if args.steps is not None:
        return args.steps
    if not 0 < args.sample_rate <= 1:
        raise ValueError(f"--sample-rate must be in (0, 1] with --epochs, got {args.sample_rate}")
    return int(args.epochs / args.sample_rate)


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def _warn_delta(args: argparse.Namespace) -> None:
    """δ >= 1/N is no guarantee (private/config.py delta_warning); said on stderr."""
    if args.dataset_size is not None:
        from .private.config import delta_warning

        if args.dataset_size < 1:
            raise ValueError(f"--dataset-size must be >= 1, got {args.dataset_size}")
        if args.delta >= 1.0 / args.dataset_size:
            print(f"dpzero {args.command}: warning: "
                  f"{delta_warning('--delta', args.delta, args.dataset_size)}", file=sys.stderr)


def cmd_budget(args: argparse.Namespace) -> int:
    _warn_delta(args)
    steps = _steps_from(args)
    phase = _C.accounting.Phase(args.sample_rate, args.noise_multiplier, steps)
    report = evaluate([phase], args.delta, args.accountant, args.eps_error)
    if args.plot:
        curve = epsilon_curve(args.sample_rate, args.noise_multiplier, steps, args.delta,
                              args.accountant, eps_error=args.eps_error)
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot_epsilon_curve(
            curve, f"q={args.sample_rate:g}, σ={args.noise_multiplier:g}, δ={args.delta:g}", args.plot)
    if args.json:
        out = _json_safe(report.to_dict())
        if args.plot:
            out["plot"] = args.plot
        json.dump(out, sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
        return 0
    print(f"q = {args.sample_rate:g}   σ = {args.noise_multiplier:g}   steps = {steps}   "
          f"δ = {args.delta:g}")
    header = f"{'accountant':<11}{'ε':>10}{'PRV lower':>12}{'PRV estimate':>14}{'best order':>12}"
    print(header)
    print("-" * len(header))
    for r in report.results:
        print(f"{r.accountant:<11}{_fmt(r.epsilon):>10}{_fmt(r.lower):>12}{_fmt(r.estimate):>14}"
              f"{_fmt(r.best_order):>12}")
        if r.error:
            print(f"  ({r.accountant}: {r.error})")
        if r.order_on_edge:
            print("  warning: the best RDP order lies on the edge of the order grid; ε may be "
                  "loose — widen the grid")
    print("ε for PRV is the upper bound (eps_error = "
          f"{args.eps_error:g}, delta_error = δ/1000).")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _json_safe(obj):
    """NaN/inf (an accountant that could not answer) become null: JSON has no NaN."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def cmd_calibrate(args: argparse.Namespace) -> int:
    _warn_delta(args)
    if args.noise_multiplier is not None:
        steps = get_steps(target_epsilon=args.target_epsilon, target_delta=args.delta,
                          sample_rate=args.sample_rate, noise_multiplier=args.noise_multiplier,
                          accountant=args.accountant, eps_error=args.eps_error)
        result = {"steps": steps}
        text = f"steps = {steps}"
    else:
        steps = _steps_from(args)
        sigma = get_noise_multiplier(
            target_epsilon=args.target_epsilon, target_delta=args.delta,
            sample_rate=args.sample_rate, steps=steps, accountant=args.accountant,
            epsilon_tolerance=args.epsilon_tolerance, eps_error=args.eps_error)
        result = {"noise_multiplier": sigma, "steps": steps}  # the steps it was calibrated for
        text = f"σ = {sigma:.6g} for {steps} steps"
    if args.json:
        json.dump({**result, "accountant": args.accountant, "target_epsilon": args.target_epsilon,
                   "delta": args.delta, "sample_rate": args.sample_rate}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"{text}   (accountant {args.accountant}, target ε = {args.target_epsilon:g}, "
              f"δ = {args.delta:g}, q = {args.sample_rate:g})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .train import launch, load
    from .train.launch import launch_config

    cfg = load(args.config)
    if args.world_size is not None:
        cfg.training.world_size = args.world_size
    if args.output is not None:
        cfg.output.dir = args.output
    results = launch(args.config, cfg, args.resume) \
        if args.world_size is None and args.output is None \
        else launch_config(cfg, args.resume)
    _print_results(cfg, results)
    return 0


def _print_results(cfg, results: dict) -> None:
    priv, base = results.get("private", {}), results.get("baseline")
    print(f"\n[dpzero train] run directory: {cfg.output.dir}")
    print(f"  private : test accuracy {priv.get('accuracy', float('nan')):.4f}  "
          f"ε = {priv.get('epsilon', float('nan')):.3f} at δ = {priv.get('delta', float('nan')):.3g}"
          f"  (σ = {priv.get('noise_multiplier', float('nan')):.4g}, q = "
          f"{priv.get('sample_rate', float('nan')):.4g}, {priv.get('steps')} steps)")
    if base:
        print(f"  baseline: trained without privacy; its results are in "
              f"{os.path.join(cfg.output.dir, 'private', 'diagnostics.md')} (not covered by ε: "
              "not to be shared)")
    if priv.get("charged_steps", 0) > priv.get("steps", 0):
        print(f"  {priv['charged_steps']} steps charged to the ledger: "
              f"{priv['charged_steps'] - priv['steps']} were trained again after a crash and "
              "charged again (ε counts them all)")
    if priv.get("stopped"):
        print(f"  stopped by the budget guard: {priv['stopped']}")
    print(f"  report: {os.path.join(cfg.output.dir, 'report.md')}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from .train import load
    from .train.sweep import format_markdown, parse_grid, price_of_tuning, run_sweep

    cfg = load(args.config)
    grid = parse_grid(args.grid, cfg)
    out = args.output or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0] + "-sweep")
    summary = run_sweep(cfg, grid, args.seeds, out)
    print("\n" + format_markdown(summary))
    print(f"[dpzero sweep] {out}: sweep.md, sweep.csv, sweep.png; one run directory per run")
    print(f"[dpzero sweep] warning: {price_of_tuning(summary)}", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .train import load
    from .train.planning import format_plan, job_plan

    cfg = load(args.config)
    world = args.world_size if args.world_size is not None else cfg.training.world_size
    if world < 1:
        raise ValueError(f"--world-size must be >= 1, got {world}")
    if args.memory_budget is not None and not args.memory_budget > 0:
        raise ValueError(f"--memory-budget must be > 0 GiB, got {args.memory_budget}")
    budget = None if args.memory_budget is None else args.memory_budget * 2.0**30
    prof, ranked, budget = job_plan(cfg, world, budget)
    if args.json:
        json.dump({"profile": prof.to_dict(), "budget_bytes": budget, "policies": [
            {"policy": r.policy.label(len(prof.units)), "stage": r.policy.stage,
             "checkpointed_units": r.policy.checkpointed,
             "offload_optimizer": r.policy.offload_optimizer, "peak_bytes": r.peak_bytes,
             "fits": r.peak_bytes <= budget, "step_s": r.step_s, "memory": r.memory,
             "time": r.time} for r in ranked]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from .planner import Policy

        configured = Policy(cfg.training.zero_stage) if cfg.training.policy == "fixed" else None
        print(format_plan(prof, ranked, budget, world, configured))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .train import write_report

    data = write_report(args.run_dir)
    print(f"[dpzero report] {os.path.join(args.run_dir, 'report.md')} ({data['steps']} steps)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpzero", description="dpzero: private training tools",
        epilog="exit status: 0 done; 2 a bad value, option or file (the message names it); 3 an "
               "accountant that cannot reach the accuracy asked for; 1 a training job that "
               "failed (its error says why)")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("budget", help="ε of a DP-SGD run under the RDP and PRV accountants")
    b.add_argument("--sample-rate", "-q", type=float, required=True, help="Poisson sample rate q")
    b.add_argument("--noise-multiplier", "-s", type=float, required=True, help="σ")
    b.add_argument("--steps", type=int, help="number of steps")
    b.add_argument("--epochs", type=float, help="epochs (steps = int(epochs / q))")
    b.add_argument("--delta", type=float, required=True)
    b.add_argument("--dataset-size", "-n", type=int,
                   help="N: warns when δ >= 1/N (no meaningful guarantee)")
    b.add_argument("--accountant", type=_accountant_list, default=list(ACCOUNTANTS),
                   help="comma-separated: rdp,prv (default both)")
    b.add_argument("--eps-error", type=float, default=0.01, help="PRV ε error (default 0.01)")
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.add_argument("--plot", metavar="PNG", help="write ε versus steps to this PNG")
    b.set_defaults(func=cmd_budget)

    c = sub.add_parser("calibrate", help="σ for a target ε (or steps, given --noise-multiplier)")
    c.add_argument("--target-epsilon", type=float, required=True)
    c.add_argument("--delta", type=float, required=True)
    c.add_argument("--dataset-size", "-n", type=int,
                   help="N: warns when δ >= 1/N (no meaningful guarantee)")
    c.add_argument("--sample-rate", "-q", type=float, required=True)
    c.add_argument("--steps", type=int)
    c.add_argument("--epochs", type=float)
    c.add_argument("--noise-multiplier", type=float,
                   help="given σ, print the largest number of steps within the target instead")
    c.add_argument("--accountant", choices=ACCOUNTANTS, default="prv")
    c.add_argument("--epsilon-tolerance", type=float, default=0.01)
    c.add_argument("--eps-error", type=float, default=0.01)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    t = sub.add_parser("train", help="private fine-tuning driven by a TOML config")
    t.add_argument("config", help="the config file (see configs/ and docs/user-guide.md)")
    t.add_argument("--world-size", type=int, help="override [training] world_size")
    t.add_argument("--output", help="override [output] dir")
    t.add_argument("--resume", action="store_true",
                   help="continue the killed run in the run directory from its last checkpoint; "
                        "every step in its ledger stays charged")
    t.set_defaults(func=cmd_train)

    sw = sub.add_parser("sweep", help="a grid of training runs at one ε: a table and a plot of "
                                      "test accuracy against each knob")
    sw.add_argument("config", help="the dpzero train config every run starts from")
    sw.add_argument("--grid", action="append", default=[], metavar="SECTION.KEY=V1,V2,...",
                    help="values of one config key (e.g. training.lr=2,4,8 or "
                         "privacy.max_grad_norm=0.05,0.1); repeat for more knobs: every "
                         "combination runs")
    sw.add_argument("--seeds", type=int, default=1,
                    help="runs per combination, seeds [training] seed, seed + 1, ... "
                         "(mean and sd in the table)")
    sw.add_argument("--output", help="the sweep's directory (default runs/<config stem>-sweep)")
    sw.set_defaults(func=cmd_sweep)

    pl = sub.add_parser("plan", help="predict memory and step time of each memory policy "
                                     "(ZeRO stage, checkpointing, offload) for a training job")
    pl.add_argument("config", help="the dpzero train config")
    pl.add_argument("--world-size", type=int, help="ranks (default: [training] world_size)")
    pl.add_argument("--memory-budget", type=float, metavar="GIB",
                    help="bytes per rank, in GiB (default: the GPU's memory, or the available "
                         "RAM over the ranks)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    r = sub.add_parser("report", help="regenerate a run's report from its ledger")
    r.add_argument("run_dir")
    r.set_defaults(func=cmd_report)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return code
    except BrokenPipeError:  # the reader stopped early (`dpzero budget --json | head`): not an
        # error of ours; stdout goes to devnull so that the interpreter's last flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, FileNotFoundError, LedgerError) as exc:  # bad values / files, named
        print(f"dpzero {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # an accountant that cannot certify the accuracy asked for
        print(f"dpzero {args.command}: error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
