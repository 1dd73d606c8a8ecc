"""``python -m meta_dist COMMAND``: the project's operations commands.

Commands:
    mpirun -np N python -m meta_dist doctor    what each rank sees; checks of the launch
    mpirun -np N python -m meta_dist bench collectives|fusion|train|checkpoint [options]
                                               the benchmarks (meta_dist.bench)
    python -m meta_dist trace merge DIR OUT.json    the ranks' traces (meta_dist_config.trace)
                                                    in one file, a track per rank
    python -m meta_dist checkpoint info|consolidate ...    as python -m meta_dist.checkpoint
"""

import sys

USAGE = ("usage: mpirun -np N python -m meta_dist doctor, mpirun -np N python -m meta_dist "
         "bench collectives|fusion|train|checkpoint [options], python -m meta_dist trace "
         "merge DIR OUT.json, or python -m meta_dist checkpoint info|consolidate ...")


def main(argv: list[str]) -> int:
    """Run the command ``argv[0]`` names; print the usage and return 2 for any other."""
    if argv[:1] == ["doctor"]:
        from meta_dist.doctor import main as doctor

        return doctor(argv[1:])
    if argv[:1] == ["bench"]:
        from meta_dist.bench import main as bench

        return bench(argv[1:])
    if argv[:1] == ["checkpoint"]:  # the name the other commands lead users to try
        from meta_dist.checkpoint.cli import main as checkpoint

        return checkpoint(argv[1:])
    if argv[:1] == ["trace"]:
        from meta_dist.trace import cli

        return cli(argv[1:])
    print(USAGE if not argv or argv[0] in ("-h", "--help") else
          f"python -m meta_dist: unknown command {argv[0]!r}; {USAGE}", file=sys.stderr)
    if argv[:1] in (["-h"], ["--help"]):
        return 0
    from meta_dist import failfast

    failfast.leave_together(2)  # every rank read the same words: leave, no job to abort
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
