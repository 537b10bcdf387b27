"""Experiment configs: YAML + --set overrides, type and value checks whose errors name the key."""

from pathlib import Path

import pytest

from clover_jax.training import config as C
from clover_jax.training.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
NAMES = ["smollm2-135m-clover2", "vicuna-7b-v1.5-clover2", "llama3-8b-instruct-clover2"]


def test_config_error_is_the_model_config_error():
    import clover_jax.models.config as mc

    assert issubclass(ConfigError, mc.ConfigError) and issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("name", NAMES)
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, C.ExperimentConfig)
    assert cfg.head.type == "clover2" and cfg.head.num_heads == 5 and cfg.head.num_aug_layers == 2
    assert (cfg.loss.decay, cfg.loss.v_weight, cfg.loss.p_weight) == (0.7, 10.0, 1.0)
    assert cfg.optim.lr == 1e-3 and cfg.optim.b2 == 0.95 and cfg.optim.clip_value == 0.5
    assert cfg.optim.warmup_steps <= cfg.train.steps <= cfg.total_steps


@pytest.mark.parametrize("name", NAMES[1:])
def test_reference_configs_match_the_recipe(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.model.dtype == "bfloat16" and cfg.train.compute_dtype == "bfloat16" and cfg.train.remat
    assert cfg.data.max_length == 2048 and cfg.data.batch_size == 16 and cfg.optim.grad_accum == 1
    assert cfg.optim.warmup_steps == 2000 and cfg.optim.weight_decay == 0.01 and cfg.optim.eps == 1e-8
    n_train = round(cfg.data.num_conversations * (1 - cfg.data.heldout_fraction))
    assert n_train == 64_600
    assert cfg.train.steps == 21 * -(-n_train // cfg.data.batch_size) == 84_798
    assert cfg.mesh.fsdp > 1 and cfg.model.name_or_path.startswith("/path/to/")


def test_defaults_are_the_reference_recipe():
    cfg = load_config(None)
    assert cfg == C.ExperimentConfig()
    assert cfg.optim.schedule == "linear" and cfg.optim.b1 == 0.9 and cfg.data.heldout_fraction == 0.05
    assert cfg.mesh.data == -1 and cfg.mesh.multi_host == "auto" and cfg.data.bucket_boundaries == "auto"
    assert cfg.checkpoint_dir == "runs/default/checkpoints"


def test_overrides_typed():
    cfg = load_config(CONFIGS / "smollm2-135m-clover2.yaml", [
        "optim.lr=5e-4",  # YAML 1.1 would read this as a string
        "data.shuffle=false",
        "data.bucket_boundaries=[128,256]",
        "optim.warmup_steps=10",
        "head.rope_theta=10000",  # int -> float
        "mesh.multi_host=true",
        "optim.clip_value=null",
        "data.system_prompt=Be brief: answer in one line.",  # not YAML, kept as text
        "model.name_or_path=/models/x",
    ])
    assert cfg.optim.lr == 5e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.data.shuffle is False
    assert cfg.data.bucket_boundaries == (128, 256)
    assert cfg.optim.warmup_steps == 10
    assert cfg.head.rope_theta == 10000.0 and isinstance(cfg.head.rope_theta, float)
    assert cfg.mesh.multi_host is True
    assert cfg.optim.clip_value is None
    assert cfg.data.system_prompt == "Be brief: answer in one line."
    assert cfg.model.name_or_path == "/models/x"
    # Later overrides win; untouched values keep the file's.
    cfg2 = load_config(CONFIGS / "smollm2-135m-clover2.yaml", ["optim.lr=1e-4", "optim.lr=2e-4"])
    import yaml

    in_file = yaml.safe_load((CONFIGS / "smollm2-135m-clover2.yaml").read_text())
    assert cfg2.optim.lr == 2e-4 and cfg2.data.max_length == in_file["data"]["max_length"]
    assert cfg.replace("train.steps=7", "optim.warmup_steps=0").train.steps == 7


@pytest.mark.parametrize("override, match", [
    ("optim.lrr=1", r"unknown key 'optim.lrr' \(did you mean 'optim.lr'\?\)"),
    ("optm.lr=1", r"unknown section 'optm' \(did you mean 'optim.lr'\?\)"),
    ("trainn.steps=3", r"unknown section 'trainn' \(did you mean 'train.steps'\?\)"),
    ("data.max_lenght=3", r"did you mean 'data.max_length'"),
])
def test_unknown_key_in_override(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"x.yaml: unknown key 'optim.learning_rate'"):
        load_config(p)
    p.write_text("optimizer:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown section 'optimizer' \(did you mean 'optim'\?\)"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(p)
    p.write_text("optim: 3\n")
    with pytest.raises(ConfigError, match="optim: expected a mapping"):
        load_config(p)


@pytest.mark.parametrize("override, match", [
    ("optim.lr=abc", r"optim.lr: expected float, got 'abc'"),
    ("train.steps=1.5", r"train.steps: expected int, got 1.5"),
    ("train.steps=true", r"train.steps: expected int, got True"),  # bool is not an int here
    ("data.shuffle=3", r"data.shuffle: expected bool, got 3"),
    ("data.bucket_boundaries=[64,x]", r"data.bucket_boundaries: expected list of int or one of 'auto'"),
    ("mesh.multi_host=maybe", r"mesh.multi_host: expected bool or one of 'auto', got 'maybe'"),
    ("model.dtype=fp16", r"model.dtype: expected one of 'float32', 'bfloat16', got 'fp16'"),
    ("optim.schedule=cos", r"optim.schedule: expected one of 'linear', 'cosine', 'constant', got 'cos'"),
])
def test_wrong_type(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_data_source_takes_one_path_or_a_list():
    assert load_config(None, ["data.source=a.jsonl"]).data.sources == ("a.jsonl",)
    cfg = load_config(None, ["data.source=[a.jsonl, data/b.jsonl.gz]"])
    assert cfg.data.source == ("a.jsonl", "data/b.jsonl.gz") == cfg.data.sources


@pytest.mark.parametrize("override, match", [
    ("optim.lr=-1e-3", r"optim.lr: must be > 0, got -0.001"),
    ("data.heldout_fraction=1.0", r"data.heldout_fraction: must be in \[0, 1\)"),
    ("data.heldout_fraction=-0.1", r"data.heldout_fraction: must be in \[0, 1\)"),
    ("data.source=conversations.csv", r"data.source: unknown source kind 'conversations.csv'"),
    ("data.bucket_boundaries=[256,128]", r"data.bucket_boundaries: must be strictly increasing"),
    ("mesh.data=0", r"mesh.data: must be -1 \(all remaining devices\) or >= 1"),
    ("optim.warmup_steps=100000", r"optim.warmup_steps: 100000 is longer than the run"),
    ("optim.grad_accum=3", r"optim.grad_accum: data.batch_size=16 is not divisible"),
])
def test_bad_value(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_sections_validate_when_built_in_python():
    with pytest.raises(ConfigError, match=r"loss.decay: must be in \(0, 1\]"):
        C.LossConfig(decay=0.0)
    with pytest.raises(ConfigError, match=r"optim.lr: expected float, got '1e-3'"):
        C.OptimConfig(lr="1e-3")


@pytest.mark.parametrize("item", ["optim.lr", "optim.lr:1e-3", ""])
def test_malformed_override(item):
    with pytest.raises(ConfigError, match="--set expects key=value"):
        load_config(None, [item])


@pytest.mark.parametrize("item", ["lr=1", "optim.adam.b1=0.9", ".lr=1"])
def test_override_needs_section_and_key(item):
    with pytest.raises(ConfigError, match="--set expects section.key=value"):
        load_config(None, [item])


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("name", NAMES)
def test_round_trip(tmp_path, name):
    cfg = load_config(CONFIGS / f"{name}.yaml", ["data.bucket_boundaries=[64,512]"])
    path = C.save_config(cfg, tmp_path / "saved" / "config.yaml")
    again = load_config(path)
    assert again == cfg
    assert C.config_to_dict(again)["data"]["bucket_boundaries"] == [64, 512]


def test_cli_arguments():
    import argparse

    parser = C.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--config", str(CONFIGS / "smollm2-135m-clover2.yaml"),
                              "--set", "train.steps=20", "--set", "optim.warmup_steps=5"])
    cfg = C.config_from_args(args)
    assert cfg.train.steps == 20 and cfg.optim.warmup_steps == 5


def test_packed_cross_entropy_and_draft_vocab_keys():
    cfg = load_config(CONFIGS / "smollm2-135m-clover2.yaml")
    assert cfg.loss.vocab_positions_per_row == 64 and cfg.train.draft_vocab_size == 8192
    with pytest.raises(ConfigError, match="loss.vocab_positions_per_row.*label mask"):
        load_config(None, ["loss.vocab_positions_per_row=32", "loss.label_mask_topk=8"])
    with pytest.raises(ConfigError, match="train.draft_vocab_size"):
        load_config(None, ["train.draft_vocab_size=-1"])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_in_the_repository_loads(path):
    """Every recipe under configs/ parses and validates, and names its head type in its file name."""
    cfg = load_config(path)
    assert cfg.head.type in path.stem
    assert cfg.optim.warmup_steps <= cfg.train.steps


def test_a_config_extends_another_and_overrides_what_differs():
    """The head types' configs for one model are overlays of one recipe: everything they do not name is the
    recipe's, and a head of another type starts from its own defaults (not from the recipe head's keys)."""
    base = load_config(CONFIGS / "smollm2-135m-clover2.yaml")
    for name in ("eagle", "medusa", "clover1", "redrafter", "block"):
        cfg = load_config(CONFIGS / f"smollm2-135m-{name}.yaml")
        assert cfg.head.type == name and cfg.train.output_dir == f"runs/smollm2-135m-{name}"
        assert cfg.data == base.data and cfg.model == base.model and cfg.mesh == base.mesh
    eagle = load_config(CONFIGS / "smollm2-135m-eagle.yaml")
    assert not hasattr(eagle.head, "num_aug_layers") and eagle.loss.p_weight == 0.1
    assert load_config(CONFIGS / "vicuna-7b-v1.5-medusa.yaml").optim.b2 == 0.999  # the overlay's own


def test_extends_errors_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="comes back to itself"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: missing.yaml\noptim:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"c.yaml: extends: no config .*missing.yaml"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("extends: [1, 2]\n")
    with pytest.raises(ConfigError, match="d.yaml: extends: expected a config file name"):
        load_config(tmp_path / "d.yaml")
    (tmp_path / "e.yaml").write_text("optim:\n  lr: 0.5\n  warmup_steps: 3\n")
    (tmp_path / "f.yaml").write_text("extends: e.yaml\noptim:\n  lr: 0.25\n")
    cfg = load_config(tmp_path / "f.yaml", ["optim.warmup_steps=4"])
    assert cfg.optim.lr == 0.25 and cfg.optim.warmup_steps == 4
