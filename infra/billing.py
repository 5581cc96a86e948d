"""What a cluster's machines have cost so far: instance-hours and their price.

An ``ec2`` cluster's instances are billed from launch: instance-hours are the sum over its live
instances of (now - ``LaunchTime``). On-demand instances are priced from ``infra.catalogue``
(indicative us-east-1 prices); spot instances at the mean of the EC2 spot price history of their
type and availability zone since their launch (``DescribeSpotPriceHistory``), since the
catalogue holds no spot prices. Where any instance's price is unknown (a type outside the
catalogue, no spot history) ``cost.usd`` is left out rather than understated. The other
backends run on machines this pipeline does not rent: nothing is logged for them.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from infra.catalogue import by_name

log = logging.getLogger(__name__)

SpotPrice = Callable[[str, str, datetime], "float | None"]


def instance_cost(instances: Iterable[Mapping[str, Any]], now: datetime, spot_price: SpotPrice) -> dict[str, float]:
    """``cost.instance_hours`` and, where every price is known, ``cost.usd`` of DescribeInstances
    records (``InstanceType``, ``LaunchTime``, ``InstanceLifecycle``, ``Placement``)."""
    hours = usd = 0.0
    priced = True
    for inst in instances:
        kind, launched = inst["InstanceType"], inst["LaunchTime"]
        h = max((now - launched).total_seconds(), 0.0) / 3600
        hours += h
        if inst.get("InstanceLifecycle") == "spot":
            price = spot_price(kind, inst.get("Placement", {}).get("AvailabilityZone", ""), launched)
        else:
            try:
                price = by_name(kind).price_per_hour
            except KeyError:
                price = None
        if price is None:
            log.warning("no price for %s instance %s (%s): cost.usd left out", kind, inst.get("InstanceId"),
                        inst.get("InstanceLifecycle", "on-demand"))
            priced = False
        else:
            usd += h * price
    return {"cost.instance_hours": hours, **({"cost.usd": usd} if priced else {})}


def cluster_cost(cluster: Any) -> dict[str, float]:
    """The cost so far of an ``infra.ec2_cluster.Ec2Cluster``'s instances."""
    ec2 = cluster.ec2

    def spot_price(kind: str, zone: str, since: datetime) -> float | None:
        query: dict[str, Any] = {"InstanceTypes": [kind], "ProductDescriptions": ["Linux/UNIX"], "StartTime": since}
        if zone:
            query["AvailabilityZone"] = zone
        prices = [float(p["SpotPrice"]) for page in ec2.get_paginator("describe_spot_price_history").paginate(**query)
                  for p in page["SpotPriceHistory"]]
        return sum(prices) / len(prices) if prices else None

    return instance_cost(cluster.live_instances(), datetime.now(timezone.utc), spot_price)
