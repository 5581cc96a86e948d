"""The training DAG's config Params: ``config`` is checked at trigger time by the config's own
JSON schema (the way Airflow checks a conf), ``config_uri`` is read by the first task, and the
layers combine as recipe < config_uri < config < the form's shortcut fields changed from their
default (left at it, a shortcut sets nothing)."""
import copy
import json

import pytest

from common.config import TrainConfig, recipe

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def form():
    pytest.importorskip("airflow.sdk")
    from plugins.params import training_params

    return training_params()


def trigger(form, **conf):
    """What Airflow does with a trigger's conf: every value through its Param's schema (on a
    copy of the form: a Param keeps the last value it resolved)."""
    from airflow.sdk.definitions.param import ParamsDict

    params = ParamsDict(copy.deepcopy(form))
    for name, value in conf.items():
        params[name] = value
    return params.validate()


def refusal(form, **conf) -> str:
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError) as info:
        trigger(form, **conf)
    return str(info.value)


def failure(params) -> str:
    """The first task's refusal of a run's params: no retry, the message."""
    from airflow.sdk.exceptions import AirflowFailException

    from plugins.pipeline_tasks import resolve_config

    with pytest.raises(AirflowFailException) as info:
        resolve_config(params)
    return str(info.value)


# The wrong values the dataclass config accepted (or failed on without naming the field), as
# the config Param gets them: (config, the field's place, the JSON type the schema expects).
WRONG = [
    ({"cluster": {"num_workers": 2.5}}, "['cluster']['num_workers']", "2.5 is not of type 'integer'"),
    ({"optim": {"batch_size": True}}, "['optim']['batch_size']", "True is not of type 'integer'"),
    ({"optim": {"epochs": 3.7}}, "['optim']['epochs']", "3.7 is not of type 'integer'"),
    ({"checkpoint": {"elastic": "false"}}, "['checkpoint']['elastic']", "'false' is not of type 'boolean'"),
    ({"optim": {"epochs": "3"}}, "['optim']['epochs']", "'3' is not of type 'integer'"),
    ({"model": {"hidden": [64, "32"]}}, "['model']['hidden'][1]", "'32' is not of type 'integer'"),
    ({"optim": {"learning_rate": "0.1"}}, "['optim']['learning_rate']", "'0.1' is not of type 'number'"),
]


@pytest.mark.parametrize("config,place,expected", WRONG, ids=[p for _, p, _ in WRONG])
def test_a_wrong_type_in_config_is_refused_at_trigger(form, config, place, expected):
    message = refusal(form, config=config)
    assert message.startswith(f"Invalid input for param config: {expected}"), message
    assert f"On instance{place}" in message, message


def test_unknown_keys_in_config_are_refused_at_trigger(form):
    assert "('epochz' was unexpected)" in refusal(form, config={"optim": {"epochz": 3}})
    assert "('optimiser' was unexpected)" in refusal(form, config={"optimiser": {}})
    assert "('zzz' was unexpected)" in refusal(form, data_options={"zzz": 1})


def test_out_of_range_and_unknown_choices_in_config_are_refused_at_trigger(form):
    assert "is greater than the maximum of 256" in refusal(form, config={"cluster": {"num_workers": 257}})
    assert "'tpu' is not one of ['cpu', 'gpu']" in refusal(form, config={"cluster": {"device": "tpu"}})


def test_a_whole_float_passes_the_schema_and_fails_the_first_task(form):
    """JSON Schema cannot tell 3.0 from 3; the strict config can, in the first task."""
    conf = trigger(form, config={"optim": {"epochs": 3.0}})
    assert "invalid configuration: optim.epochs must be an integer, got 3.0 (a number)" in failure(conf)


@pytest.mark.parametrize("config,message", [
    ({"cluster": {"num_workers": 2.5}}, "cluster.num_workers must be an integer, got 2.5 (a number)"),
    ({"optim": {"batch_size": True}}, "optim.batch_size must be an integer, got True (a boolean)"),
    ({"optim": {"epochs": 3.7}}, "optim.epochs must be an integer, got 3.7 (a number)"),
    ({"checkpoint": {"elastic": "false"}}, "checkpoint.elastic must be true or false, got 'false' (a string)"),
    ({"optim": {"epochz": 3}}, "unknown config key 'optim.epochz'"),
])
def test_the_first_task_refuses_what_the_form_did_not_check(form, config, message):
    """A conf that skipped the form (an API client, a direct call) fails without a retry."""
    params = {**trigger(form), "config": config}
    assert failure(params).startswith(f"invalid configuration: {message}")


def test_the_defaults_resolve_to_the_digits_recipe(form):
    from plugins.run_config import resolve

    cfg = resolve(trigger(form))
    assert cfg == recipe("digits", form["dataset_uri"].value)


def test_a_recipe_from_an_untouched_form_is_that_recipe(form):
    """The form shows the digits recipe's values as its defaults; a run triggered with another
    recipe and nothing else changed trains that recipe, not the digits values it shows."""
    from plugins.run_config import resolve

    cfg = resolve(trigger(form, recipe="debug"))
    assert cfg.to_dict() == recipe("debug", form["dataset_uri"].value).to_dict()


def test_precedence_recipe_config_uri_config_form(form, tmp_path):
    from plugins.run_config import resolve

    uri = tmp_path / "run.json"
    uri.write_text(json.dumps({"optim": {"epochs": 7, "weight_decay": 0.01, "warmup_steps": 5},
                               "cluster": {"job_timeout_s": 600}, "seed": 3}))
    conf = trigger(form, recipe="debug", config_uri=str(uri),
                   config={"optim": {"epochs": 9, "warmup_steps": 6}, "checkpoint": {"keep": 4}},
                   weight_decay=0.5)
    cfg = resolve(conf)
    assert cfg.optim.epochs == 9  # config over config_uri; the form's epochs is at its default: sets nothing
    assert cfg.optim.warmup_steps == 6 and cfg.checkpoint.keep == 4 and cfg.seed == 3
    assert cfg.cluster.job_timeout_s == 600  # config_uri over the recipe (the form field at its default)
    assert cfg.optim.weight_decay == 0.5  # a form field changed from its default wins over both
    # The form field at its default (the digits recipe's) sets nothing: the chosen recipe's value stands.
    assert form["checkpoint_every_n_steps"].value != recipe("debug").checkpoint.every_n_steps
    assert cfg.checkpoint.every_n_steps == recipe("debug").checkpoint.every_n_steps
    assert cfg.model.hidden == recipe("debug").model.hidden  # nothing else sets it: the recipe's
    changed = resolve({**conf, "epochs": 11, "checkpoint_every_n_steps": 7})
    assert changed.optim.epochs == 11  # changed: over config
    assert changed.checkpoint.every_n_steps == 7  # changed: over the recipe


def test_data_options_win_over_config_data(form):
    from plugins.run_config import resolve

    conf = trigger(form, config={"data": {"id_column": "a", "drift_action": "off"}}, data_options={"id_column": "b"})
    cfg = resolve(conf)
    assert cfg.data.id_column == "b" and cfg.data.drift_action == "off"


def test_new_shortcut_fields_set_the_config(form):
    from plugins.run_config import resolve

    cfg = resolve(trigger(form, device="gpu", devices_per_worker=2, lr_schedule="cosine", weight_decay=0.001,
                          dropout=0.2, job_timeout_s=900))
    assert (cfg.cluster.device, cfg.cluster.devices_per_worker, cfg.cluster.job_timeout_s) == ("gpu", 2, 900)
    assert (cfg.optim.lr_schedule, cfg.optim.weight_decay, cfg.model.dropout) == ("cosine", 0.001, 0.2)


def test_shortcut_fields_take_their_schema_from_the_config(form):
    """Types, bounds and enums are the config field's (narrowed only by the form's caps)."""
    from plugins.params import SHORTCUTS, section_schema

    narrowed = {"dataset_uri": {"pattern"}, "label_column": {"maxLength"}, "epochs": {"maximum"},
                "batch_size": {"maximum"}, "num_workers": {"maximum"}, "num_servers": {"maximum"},
                "kvstore": {"enum"}, "checkpoint_every_n_steps": {"maximum"}}
    for name, (section, field) in SHORTCUTS.items():
        own = section_schema(section)["properties"][field]
        schema = form[name].schema
        # A shortcut's description is the form's own (it names its field); the rest is the field's.
        for key in set(own) - {"default", "title", "description"} - narrowed.get(name, set()):
            assert schema[key] == own[key], (name, key)
        assert form[name].value == getattr(getattr(recipe("digits"), section), field) or name == "dataset_uri"
    assert form["device"].schema["enum"] == ["cpu", "gpu"]
    assert form["devices_per_worker"].schema == {"type": "integer", "minimum": 1, "maximum": 16}
    assert form["dropout"].schema == {"type": "number", "minimum": 0, "exclusiveMaximum": 1}
    assert form["job_timeout_s"].schema == {"type": "number", "minimum": 0}  # 0: no limit
    for name in SHORTCUTS:
        assert "left at its default, sets nothing" in form[name].description, name


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "optim:\n  epochs: 5\n  lr_schedule: step\n  lr_decay_epochs: [2, 4]\ncheckpoint:\n  elastic: false\n"),
    (".yml", "optim: {epochs: 5, lr_schedule: step, lr_decay_epochs: [2, 4]}\ncheckpoint: {elastic: false}\n"),
    (".json", json.dumps({"optim": {"epochs": 5, "lr_schedule": "step", "lr_decay_epochs": [2, 4]},
                          "checkpoint": {"elastic": False}})),
])
def test_config_uri_reads_yaml_and_json_from_a_local_file(form, tmp_path, suffix, text):
    from plugins.run_config import resolve

    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    cfg = resolve(trigger(form, config_uri=str(path)))
    assert cfg.optim.epochs == 5 and cfg.optim.lr_decay_epochs == (2, 4) and cfg.checkpoint.elastic is False


@pytest.mark.parametrize("name,text,message", [
    ("types.yaml", "optim:\n  epochs: '3'\ncheckpoint:\n  elastic: 'false'\n",
     "invalid configuration: optim.epochs must be an integer, got '3' (a string)\n"
     "checkpoint.elastic must be true or false, got 'false' (a string)"),
    ("unknown.yaml", "optim:\n  epochz: 3\n", "unknown config key 'optim.epochz'"),
    ("list.yaml", "- optim\n", "must hold an object of config sections, got list"),
    ("section.json", '{"optim": 3}', ": config section 'optim' must be a JSON object, got an integer"),
    ("broken.yaml", "optim: {epochs: 3\n", "is not valid YAML"),
    ("broken.json", '{"optim": }', "is not valid JSON: Expecting value at line 1 column 11"),
])
def test_a_bad_config_file_fails_the_first_task_naming_the_problem(form, tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    assert message in failure(trigger(form, config_uri=str(path)))


def test_a_missing_config_file_fails_the_first_task(form, tmp_path):
    missing = tmp_path / "none.yaml"
    assert failure(trigger(form, config_uri=str(missing))) == f"invalid configuration: config_uri {missing}: no such file"


def test_config_uri_must_be_a_json_or_yaml_file(form):
    assert "config_uri" in refusal(form, config_uri="/tmp/run.txt")
    assert "config_uri" in refusal(form, config_uri="s3:/b/run.yaml")
    assert trigger(form, config_uri="s3://bucket/runs/a.yml")["config_uri"] == "s3://bucket/runs/a.yml"


def test_the_config_schema_accepts_every_field_of_a_full_config(form):
    full = json.loads(TrainConfig.from_dict({"data": {"source_uri": "/d.csv"}}).to_json())
    assert trigger(form, config=full)["config"] == full
