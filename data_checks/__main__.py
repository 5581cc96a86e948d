"""Command line of the data stage; runs with no Airflow at all.

    python -m data_checks shard --config cfg.json --out PREFIX
        Shards ``data.source_uri`` of the config into RecordIO shards + manifest under PREFIX.
    python -m data_checks shard --config cfg.json --under ROOT [--parts N]
        The same under ROOT/{fingerprint[:16]} (reused when source and settings are unchanged);
        with --parts, in N parts of the source one after the other (``data_checks.parts``, as the
        DAG's mapped tasks do; 0: one per 256 MB): the same shards.
    python -m data_checks validate --config cfg.json --shards PREFIX [--report PREFIX]
                                   [--previous MANIFEST] [--docs]
        Runs the Great Expectations suites over the shards and the cross-shard checks (drift
        against a previous manifest if given); exit code 1 on failure.

A missing or invalid config file is a usage error: one line on stderr, exit code 2.
"""
from __future__ import annotations

import json
import logging
import sys

from common.cli import parser as cli_parser
from common.cli import usage_errors
from common.errors import DataError

EXAMPLES = """
python -m training config --recipe digits --dataset digits.csv > cfg.json
python -m data_checks shard    --config cfg.json --out shards/
python -m data_checks validate --config cfg.json --shards shards/ --report report/
"""


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser("The data stage without Airflow: shard a config's source dataset into RecordIO shards "
                        "and validate them with Great Expectations (exit status 1 when a check fails).",
                        EXAMPLES, prog="python -m data_checks")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shard", help="shard the config's source dataset")
    s.add_argument("--config", required=True, help="TrainConfig JSON file")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="prefix for shards and manifest.json")
    where.add_argument("--under", help="root for content-addressed shards (ROOT/{fingerprint[:16]})")
    s.add_argument("--parts", type=int, help="with --under: shard in this many parts of the source, as the DAG's "
                                             "mapped tasks do (0: one per 256 MB); the shards are the same")
    v = sub.add_parser("validate", help="validate shards with Great Expectations")
    v.add_argument("--config", required=True, help="TrainConfig JSON file")
    v.add_argument("--shards", required=True, help="prefix holding manifest.json")
    v.add_argument("--report", help="prefix to write validation.json / validation.html to")
    v.add_argument("--previous", help="a previous manifest (or its prefix) to check label drift against")
    v.add_argument("--docs", action="store_true", help="also build each shard's GX Data Docs page")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")

    from common.config import ConfigError, TrainConfig

    with usage_errors(ConfigError):
        cfg = TrainConfig.from_file(args.config)
    try:
        if args.cmd == "shard":
            from data_checks.shard import shard_content_addressed, shard_dataset

            if args.parts is not None and not args.under:
                parser.error("--parts needs --under (mapped sharding is content-addressed)")
            if args.out:
                prefix, manifest, reused = args.out, shard_dataset(cfg, args.out), None
            elif args.parts is not None:
                from data_checks.parts import shard_in_parts

                prefix, manifest, reused = shard_in_parts(cfg, args.under, args.parts)
            else:
                prefix, manifest, reused = shard_content_addressed(cfg, args.under)
            print(json.dumps({"shards": prefix, "reused": reused, "fingerprint": manifest["source_fingerprint"],
                              "splits": manifest["splits"],
                              "num_classes": manifest["num_classes"]}, indent=2))
        else:
            from data_checks.validate import validate_shards

            print(json.dumps(validate_shards(args.shards, cfg, report_prefix=args.report,
                                             previous_manifest_uri=args.previous, docs=args.docs), indent=2))
    except (ConfigError, DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
