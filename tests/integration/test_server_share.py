"""A model whose big arrays are split over 4 servers, trained as a real job: each server's share
of the traffic is what MXNet 1.9's key assignment predicts (``testkit.server_load``), and the
largest is within 1.5 × the mean (issue 28's goal; ``benchmarks/big_model.py`` measures it at
100 M parameters).

The small-size twin of that benchmark: the ``debug`` recipe's MLP widened to (256, 256) (85 k
parameters), 2 workers and 4 servers, with ``MXNET_KVSTORE_BIGARRAY_BOUND`` lowered in the roles'
environment to 10,000 values, so its two hidden weight arrays (16,384 and 65,536 values) are cut
into one part per server as a 100 M model's are at MXNet's default bound (the output layer's 2,560
go whole to server 0: 1.09 × the mean); at that default no array of this model is cut and server 2
would hold 3.1 times the mean (the unit tests show the rule).
"""
import pytest

from testkit.local_jobs import make_job, run_job, shard_digits
from testkit.server_load import ServerSampler, imbalance, mlp_keys, ranked, server_elements, shares

pytestmark = pytest.mark.integration

HIDDEN = (256, 256)
BOUND = 10_000
SERVERS = 4


def test_four_servers_each_carry_their_predicted_share_of_a_split_model(s3_server, digits_csv, tmp_path):
    prefix = f"s3://{s3_server.bucket}/test-server-share"
    cfg, shards = shard_digits(prefix, digits_csv)
    cfg = cfg.replace(model={"hidden": HIDDEN}, optim={"epochs": 1},
                      cluster={"num_workers": 2, "num_servers": SERVERS, "kvstore": "dist_sync",
                               "optimizer_on": "workers"})
    job = make_job(cfg, shards, prefix)
    with ServerSampler(str(tmp_path / "home"), every_s=0.2) as sampler:
        roles = run_job(job, prefix, tmp_path, {"MXNET_KVSTORE_BIGARRAY_BOUND": str(BOUND)})
    assert sorted(r for r in roles if r.startswith("server-")) == [f"server-{i}" for i in range(SERVERS)]
    assert not sampler.errors
    predicted = shares(server_elements([size for _, size in mlp_keys(64, HIDDEN, 10)], SERVERS, BOUND))
    (servers,) = sampler.attempts()  # one attempt: no failure
    received = [servers[f"server-{i}"].received for i in range(SERVERS)]
    sent = [servers[f"server-{i}"].sent for i in range(SERVERS)]
    # Pushes in, pulls out: the servers' byte shares within 2 points of their shares of the values
    # (message headers and the scheduler's control traffic are the rest), compared largest first:
    # the role server-i need not be ps-lite's server rank i.
    for got in (shares(received), shares(sent)):
        assert max(abs(g - p) for g, p in zip(ranked(got), ranked(predicted))) < 0.02, (got, predicted)
    assert imbalance(received) <= 1.5 and imbalance(sent) <= 1.5
