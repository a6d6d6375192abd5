#!/usr/bin/env python3
"""Before against after, in one run: idempo's per-message and batch speed on
RabbitMQ and on JetStream, measured alternately with the benches built at a
base revision and at the work tree.

    scripts/bench-compare.py BASE_REV [--rounds N] [--messages N]

The base is built in a worktree under target/bench-base (a target directory
of its own, so neither build evicts the other). Each round runs every
variant once with each build, the order of the two builds alternating from
round to round, so that the machine's drift falls on both alike. Prints, per
variant, the median msg/s of each build and after/base per round and of the
medians, as a Markdown table for BENCHMARKS.md.

Needs what the benches need: RabbitMQ, NATS with JetStream and PostgreSQL
on their usual local ports (see README.md).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_DIR = os.path.join(ROOT, "target", "bench-base")
FEATURES = "amqp,nats"

# (label, bench, argument, environment)
VARIANTS = [
    ("RabbitMQ per message (idempo-c16)", "throughput", ["--variant", "e:idempo-c16"], {}),
    ("RabbitMQ batch (idempo-batch500)", "throughput", ["--variant", "f:idempo-batch500"], {}),
    ("JetStream per message (idempo-c16)", "jetstream", ["idempo-c16"], {"BENCH_ROUNDS": "1"}),
    ("JetStream batch (idempo-batch100)", "jetstream", ["idempo-batch100"], {"BENCH_ROUNDS": "1"}),
]


def build(source_dir, target_dir):
    """Builds the two benches; their executables by name."""
    env = dict(os.environ, CARGO_TARGET_DIR=target_dir)
    out = subprocess.run(
        ["cargo", "bench", "--no-run", "--features", FEATURES,
         "--bench", "throughput", "--bench", "jetstream", "--message-format=json"],
        cwd=source_dir, env=env, check=True, stdout=subprocess.PIPE, text=True,
    ).stdout
    exes = {}
    for line in out.splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("reason") == "compiler-artifact" and msg.get("executable"):
            exes[msg["target"]["name"]] = msg["executable"]
    missing = {"throughput", "jetstream"} - exes.keys()
    if missing:
        sys.exit(f"the build at {source_dir} made no bench {sorted(missing)}")
    return exes


def base_tree(rev):
    """A worktree of `rev` under target/bench-base/src."""
    src = os.path.join(BASE_DIR, "src")
    want = subprocess.run(["git", "rev-parse", rev + "^{commit}"], cwd=ROOT, check=True,
                          stdout=subprocess.PIPE, text=True).stdout.strip()
    if os.path.isdir(src):
        # Kept when it is already at `rev`: a new worktree has new mtimes,
        # which would rebuild the base for nothing.
        have = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src,
                              stdout=subprocess.PIPE, text=True).stdout.strip()
        clean = subprocess.run(["git", "status", "--porcelain"], cwd=src,
                               stdout=subprocess.PIPE, text=True).stdout.strip() == ""
        if have == want and clean:
            return src
        subprocess.run(["git", "worktree", "remove", "--force", src], cwd=ROOT, check=True)
    subprocess.run(["git", "worktree", "add", "--detach", "--force", src, rev], cwd=ROOT, check=True)
    return src


def rate_of(bench, output):
    if bench == "throughput":
        line = next((l for l in output.splitlines() if l.startswith("FIGURES ")), None)
        if line is None:
            raise RuntimeError("no FIGURES line")
        figures = json.loads(line[len("FIGURES "):])
        return figures["messages"] / figures["seconds"]
    match = re.search(r"= (\d+) msg/s", output)
    if match is None:
        raise RuntimeError("no msg/s line")
    return float(match.group(1))


def run(exe, bench, args, env, messages):
    environment = dict(os.environ, **env)
    environment.setdefault("BENCH_COUNT_TRIPS", "0")
    if messages:
        environment["BENCH_MESSAGES"] = str(messages)
    elif bench == "jetstream":
        environment["BENCH_MESSAGES"] = "50000" if "batch" in args[0] else "20000"
    done = subprocess.run([exe, *args], cwd=ROOT, env=environment,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{exe} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return rate_of(bench, done.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the revision to compare against, e.g. c1ac5e2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=0,
                        help="messages per variant (default: the benches' own, 50,000 for JetStream batches)")
    opts = parser.parse_args()

    builds = {
        "base": build(base_tree(opts.base), os.path.join(BASE_DIR, "target")),
        "after": build(ROOT, os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))),
    }
    rates = {(label, side): [] for label, *_ in VARIANTS for side in builds}
    for round_ in range(opts.rounds):
        sides = ["base", "after"] if round_ % 2 == 0 else ["after", "base"]
        for label, bench, args, env in VARIANTS:
            for side in sides:
                rate = run(builds[side][bench], bench, args, env, opts.messages)
                rates[(label, side)].append(rate)
                print(f"round {round_} {side:>5} {label}: {rate:.0f} msg/s", flush=True)

    print(f"\nbase {opts.base} against the work tree, {opts.rounds} rounds, alternating\n")
    print("| variant | base msg/s (median) | after msg/s (median) | after / base | per round |")
    print("|---|---:|---:|---:|---|")
    for label, *_ in VARIANTS:
        base, after = rates[(label, "base")], rates[(label, "after")]
        per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(after, base))
        ratio = statistics.median(after) / statistics.median(base)
        print(f"| {label} | {statistics.median(base):,.0f} | {statistics.median(after):,.0f} "
              f"| **{ratio:.3f}×** | {per_round} |")


if __name__ == "__main__":
    main()
