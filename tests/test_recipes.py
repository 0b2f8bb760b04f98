"""Every built-in recipe loads against the schema of every CLI section it holds."""

from __future__ import annotations

import dataclasses

import pytest

from specheads.config import PROGS, SECTIONS, UserError, _read_yaml, list_recipes, load_config, schema_for

RECIPES = list_recipes()


def _sections(path: object) -> list[str]:
    try:
        return [k for k in _read_yaml(path) if k in SECTIONS]  # type: ignore[arg-type]
    except UserError:
        return []  # an unreadable recipe fails test_recipe_keys_are_known instead


PAIRS = [(name, section) for name, path in RECIPES.items() for section in _sections(path)]


@pytest.mark.parametrize("name, section", PAIRS, ids=[f"{n}-{s}" for n, s in PAIRS])
def test_recipe_section_loads(name: str, section: str) -> None:
    schema = schema_for(section)  # every section's schema exists: a renamed module fails here, never skips
    cfg = load_config(schema, section, [f"recipe={name}"])
    assert isinstance(cfg, schema)


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_keys_are_known(name: str) -> None:
    data = _read_yaml(RECIPES[name])
    unknown_sections = [k for k in data if k in PROGS and not isinstance(data[k], dict)]
    assert not unknown_sections, f"recipe {name!r}: sections must be mappings: {unknown_sections}"
    common = [k for k in data if k not in PROGS and k != "description"]
    if not common:
        return
    fields = {f.name for section in SECTIONS for f in dataclasses.fields(schema_for(section))}
    stray = [k for k in common if k not in fields]
    assert not stray, (
        f"recipe {name!r}: common keys {stray} are fields of no CLI schema ({', '.join(SECTIONS.values())})"
    )


def _accelerate_configs() -> list[str]:
    from importlib.resources import files

    return sorted(
        p.name[: -len(".yaml")]
        for p in (files("specheads.recipes") / "accelerate").iterdir()
        if p.name.endswith(".yaml")
    )


ACCELERATE_CONFIGS = _accelerate_configs()


def test_the_launcher_configs_are_all_there() -> None:
    shipped = {"ddp", "deepspeed_zero2", "deepspeed_zero3", "multi_node_ddp", "multi_node_zero2", "multi_node_zero3"}
    assert shipped <= set(ACCELERATE_CONFIGS)


@pytest.mark.parametrize("name", ACCELERATE_CONFIGS)
def test_accelerate_configs_parse(name: str) -> None:
    """Every launcher config shipped in recipes/accelerate/ is a valid ``accelerate`` config file for
    GPUs in bf16: ZeRO stage from the name, several processes per machine, a rendezvous address
    for several machines."""
    from importlib.resources import files

    from accelerate.commands.config.config_args import load_config_from_file

    path = files("specheads.recipes") / "accelerate" / f"{name}.yaml"
    cfg = load_config_from_file(str(path))
    assert cfg.mixed_precision == "bf16" and not cfg.use_cpu
    assert cfg.num_processes >= 2 and cfg.num_processes % cfg.num_machines == 0
    stage = {"zero2": 2, "zero3": 3}.get(name.rsplit("_", 1)[-1])
    if stage is not None:
        assert cfg.distributed_type.value == "DEEPSPEED" and cfg.deepspeed_config["zero_stage"] == stage
        assert cfg.deepspeed_config.get("zero3_init_flag") is False  # the draft model is never partitioned
    else:
        assert cfg.distributed_type.value == "MULTI_GPU"
    if "multi_node" in name:
        assert cfg.num_machines >= 2 and cfg.machine_rank == 0
        assert cfg.main_process_ip and isinstance(cfg.main_process_port, int) and cfg.rdzv_backend == "static"
        if stage is not None:  # torchrun on each node, no hostfile/pdsh
            assert cfg.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    else:
        assert cfg.num_machines == 1
    if name.startswith("multi_node"):  # the training configs: 2 nodes x 8 GPUs
        assert (cfg.num_machines, cfg.num_processes) == (2, 16)


@pytest.mark.parametrize("name", [n for n in ACCELERATE_CONFIGS if "multi_node" in n])
def test_multi_node_configs_give_each_node_its_share(name: str) -> None:
    """What ``accelerate launch --config_file <name>.yaml --machine_rank 1 ...`` hands torchrun on the
    second node: num_processes / num_machines processes on each node (8 on each of 2 for the
    training configs), this one rank 1, the rendezvous at node 0."""
    from importlib.resources import files

    launch = pytest.importorskip("accelerate.commands.launch")
    if not hasattr(launch, "_validate_launch_command"):
        pytest.skip("this accelerate version has no _validate_launch_command")
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    path = files("specheads.recipes") / "accelerate" / f"{name}.yaml"
    args = launch.launch_command_parser().parse_args(
        ["--config_file", str(path), "--machine_rank", "1", "-m", "specheads.train.cli", "recipe=quickstart"]
    )
    args, defaults, _ = launch._validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        cmd, env = prepare_deepspeed_cmd_env(args)
        assert cmd is None and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(defaults.deepspeed_config["zero_stage"])
    else:
        env = prepare_multi_gpu_env(args)
    share = defaults.num_processes // defaults.num_machines
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == (str(share), str(defaults.num_machines), 1)
    if name.startswith("multi_node"):
        assert share == 8
    assert f"{defaults.main_process_ip}:{defaults.main_process_port}" in (
        getattr(args, "rdzv_endpoint", ""),
        f"{getattr(args, 'master_addr', '')}:{getattr(args, 'master_port', '')}",
    )
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_a_common_pipeline_key_goes_to_the_stages_that_take_it() -> None:
    """``heads-pipeline eagle=HEAD`` sets eval's EAGLE head and leaves train's ``eagle`` section alone; a section's
    setting without a stage prefix reaches the one stage that has it; a key no stage takes is one line."""
    from specheads.pipeline import load_configs

    _, cfgs = load_configs(["recipe=quickstart", "eagle=recipes/heads/other.safetensors", "eagle.ttt_steps=5"])
    assert cfgs["eval"].eagle == "recipes/heads/other.safetensors"
    assert cfgs["train"].eagle.ttt_steps == 5
    with pytest.raises(UserError, match="no stage has a key 'eagle.colour'"):
        load_configs(["recipe=quickstart", "eagle.colour=red"])
