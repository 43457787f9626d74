"""``python -m autoshard <command>``: ``plan`` (the planner, ``autoshard/planner/cli.py``)."""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("plan",):
        print("usage: python -m autoshard plan --model ... --gpus N --cluster dgx-a100 --global-batch B [--seq S]\n"
              "       (python -m autoshard plan --help for more)", file=sys.stderr)
        return 2
    from autoshard.planner.cli import main as plan_main
    return plan_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
