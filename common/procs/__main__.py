"""``python -m common.procs``: host-side helpers a cluster runs through its transport (nothing
here imports mxnet)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from common.cli import parser as cli_parser
from common.procs.ports import free_port
from common.procs.records import exec_role, kill_recorded


EXAMPLES = """
python -m common.procs exec-role --record /tmp/job/procs/worker-0.json -- python -m training worker JOB_URI
python -m common.procs kill-records /tmp/job/procs --grace-s 5 --wait-s 35
python -m common.procs free-port 127.0.0.1
"""


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser("Host-side helpers a cluster runs through its transport (ssh, ip netns exec, SSM): "
                        "start a role as the leader of a recorded process group, stop the recorded groups, "
                        "find a free port.", EXAMPLES, prog="python -m common.procs")
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("exec-role", help="lead a new process group, record it, exec ARGV")
    e.add_argument("--record", required=True)
    e.add_argument("--env-file", help="JSON {name: {VAR: value}}: the environment to exec with")
    e.add_argument("--env-key", help="which entry of --env-file (default: the record's name)")
    e.add_argument("argv", nargs=argparse.REMAINDER)
    k = sub.add_parser("kill-records", help="stop every recorded group under DIR (recursively)")
    k.add_argument("dir")
    k.add_argument("--grace-s", type=float, default=5.0)
    k.add_argument("--wait-s", type=float, default=0.0,
                   help="first wait this long for the groups to exit on their own (default 0)")
    k.add_argument("--names", help="comma-separated record names: stop only these (default: every one)")
    f = sub.add_parser("free-port", help="print a TCP port free on ADDRESS")
    f.add_argument("address")
    args = parser.parse_args(argv)
    if args.cmd == "exec-role":
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not cmd:
            parser.error("exec-role needs a command after --")
        env = None
        if args.env_file:
            with open(args.env_file) as fh:
                key = args.env_key or os.path.basename(args.record).removesuffix(".json")
                env = json.load(fh)[key]
        exec_role(args.record, cmd, env)
    if args.cmd == "kill-records":
        stopped: list[str] = []
        for root, _dirs, files in os.walk(args.dir):
            if any(f.endswith(".json") for f in files):
                stopped += kill_recorded(root, grace_s=args.grace_s, wait_s=args.wait_s,
                                         names=set(args.names.split(",")) if args.names else None)
        print(json.dumps({"stopped": stopped}))
        return 0
    print(free_port(args.address))
    return 0


if __name__ == "__main__":
    sys.exit(main())
