"""The config Params as the Airflow server sees them: it validates a trigger's conf against the
DAG's *serialized* params, so the generated schemas must survive serialization intact."""
import pytest

pytestmark = pytest.mark.dag


@pytest.fixture(scope="module")
def served(dag):
    from airflow.serialization.serialized_objects import DagSerialization

    return DagSerialization.from_dict(DagSerialization.to_dict(dag)).params


def test_the_schemas_survive_serialization(dag, served):
    assert set(served) == set(dag.params)
    for name in dag.params:
        assert served.get_param(name).schema == dag.params.get_param(name).schema, name
        assert served.get_param(name).description == dag.params.get_param(name).description, name


# Each wrong value through the form: tests/unit/test_run_config.py; here, that the server's copy
# of the schema (with its $defs) refuses as the DAG's own does.
@pytest.mark.parametrize("config,problem", [({"checkpoint": {"elastic": "false"}}, "'false' is not of type 'boolean'"),
                                            ({"optim": {"epochz": 3}}, "('epochz' was unexpected)")])
def test_the_server_refuses_a_wrong_config(served, config, problem):
    from airflow.sdk.exceptions import ParamValidationError

    param = served.get_param("config")
    param.value = config
    try:
        with pytest.raises(ParamValidationError, match="Invalid input for param config") as info:
            served.validate()
    finally:
        param.value = {}
    assert problem in str(info.value)


def test_the_server_accepts_a_partial_config(served):
    param = served.get_param("config")
    param.value = {"optim": {"lr_schedule": "step", "lr_decay_epochs": [5]}, "seed": 1}
    try:
        assert served.validate()["config"]["seed"] == 1
    finally:
        param.value = {}
