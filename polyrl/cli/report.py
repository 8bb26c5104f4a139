"""``polyrl report RUN_DIR``: plots and a Markdown summary of a run (see polyrl.core.run.report)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="plot a run's curves and summarise it",
        description="Write RUN_DIR/report.png (reward, losses, KL, clip fractions, response length over steps) "
                    "and RUN_DIR/report.md (a summary) from RUN_DIR/metrics.jsonl.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (the --output of polyrl run)")


def main(args: argparse.Namespace) -> int:
    from polyrl.core.run.report import write_report

    png_path, md_path = write_report(args.run_dir)
    print(f"wrote {png_path}")
    print(f"wrote {md_path}")
    return 0
