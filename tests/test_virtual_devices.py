"""The device sanitizer (specheads.runtime.virtual_devices) and every path of a target split over two virtual GPUs
(tests/device_paths.py): an operation that mixes devices fails with the operation and both devices named."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from specheads.runtime.virtual_devices import DeviceMismatch, VirtualGPUs, device_of


def test_a_split_model_computes_what_the_whole_one_does_and_gives_its_logits_on_the_last_gpu():
    model = tiny_llama(40, layers=4)
    ids = torch.tensor([[1, 5, 7, 9]])
    whole = model(ids).logits
    with VirtualGPUs(2) as vg:
        placed = vg.split(model)
        out = model(ids.to("cuda:0")).logits
        assert out.device == torch.device("cuda", 1) and torch.equal(out.cpu(), whole)
        assert placed["model.embed_tokens"].index == 0 and placed["lm_head"].index == 1
        assert sum(vg.ops.values()) > 100 and vg.moves >= 2


def test_mixing_two_gpus_fails_naming_the_op_and_both_devices():
    with VirtualGPUs(2):
        a, b = torch.zeros(3, device="cuda:0"), torch.ones(3, device="cuda:1")
        for op, call in (("Tensor.add", lambda: a + b), ("torch.cat", lambda: torch.cat([a, b]))):
            with pytest.raises(DeviceMismatch, match=rf"{op} mixes devices cuda:0 .*, cuda:1"):
                call()
        with pytest.raises(DeviceMismatch, match="__getitem__"):
            a[torch.tensor([0]).to("cuda:1")]  # a GPU index on another GPU
        with pytest.raises(DeviceMismatch, match="numpy"):
            a.numpy()
        g = torch.Generator(device="cuda:1")
        with pytest.raises(DeviceMismatch, match="generator"):
            torch.rand(2, generator=g)  # a CUDA generator cannot draw into a CPU tensor
        with pytest.raises(DeviceMismatch, match="__setitem__"):
            a[torch.tensor([0])] = torch.ones(1)  # advanced indexing: index_put_ wants the value on a's device
        # what PyTorch allows on GPUs: CPU scalars and CPU index tensors, copies across devices (also a value
        # set through basic indexing, a copy_ into a view)
        a[1:] = torch.ones(2)
        b[0] = a[1:2]
        assert (a + torch.tensor(2.0)).device == a.device and a[torch.tensor([1])].device == a.device
        assert device_of(b.to(a.device)) == a.device and a.copy_(b).device == a.device
        assert torch.rand(2, generator=g, device=g.device).device == g.device
        assert torch.nn.Parameter(b[:2]).device == b.device  # a parameter made from a GPU tensor stays there


def test_outside_the_mode_nothing_changes():
    with VirtualGPUs(2):
        x = torch.zeros(2, device="cuda:1")
    assert x.device.type == "cpu" and not torch.cuda.is_available()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import device_paths

    return device_paths.build(tmp_path_factory.mktemp("devices"))


def _paths():
    import device_paths

    return sorted(device_paths.PATHS)


@pytest.mark.slow
@pytest.mark.parametrize("name", _paths())
def test_every_path_of_a_split_target_keeps_its_devices(name, built, tmp_path):
    """Each path failed before its fix (decode_eagle_*: the head's states came from the last GPU, issue 59 item 1;
    decode_eagle_stop_head / _verifier: those heads sat on the last GPU, item 2; datagen_judge_mining_eagle:
    the layers' states were joined across GPUs, item 3; eval_eagle_fidelity: the index was on the first GPU,
    item 4)."""
    import device_paths

    assert device_paths.run_path(name, built, tmp_path / name) > 1000


def _reverts():
    import device_paths

    return sorted(device_paths.reverts())


@pytest.mark.slow
@pytest.mark.parametrize("fix", _reverts())
def test_a_reverted_device_fix_is_caught(fix, built, tmp_path):
    """Each device fix reverted (issue 59 item 1: the drafter keeps the target's states where they came out;
    item 2: the stop head sits on the last GPU; item 3: EAGLE mining joins the layers' states where each came
    out; item 4: fidelity indexes the last GPU's logits from the first): the sanitizer names the op and both
    devices."""
    import device_paths

    patch, path, message = device_paths.reverts()[fix]
    with patch, pytest.raises(DeviceMismatch, match=message):
        device_paths.run_path(path, built, tmp_path / "x")


TREE = ["policy=tree", "tree.k=3", "tree.tree_width=2", "tree.tree_nodes=4"]


@pytest.mark.slow
def test_trees_run_on_one_gpu_without_an_opt_in_and_a_split_target_is_refused_before_any_row(built, tmp_path):
    """policy=tree on a target on one (virtual) GPU decodes the CPU's tokens without SPECHEADS_FUSED_CUDA (the
    tree's runner takes the fused forward there: issue 59 item 7, which failed mid-sweep before); on a split
    target the decoder refuses it in one line when it is built, before any prompt decodes."""
    import json

    from specheads.decode.decode_cli import main as decode
    from specheads.errors import UserError

    def run(out, *where):
        args = [f"target.path={built['target']}", "target.gguf_file=null", "draft.path=''", *where, *TREE]
        args += [f"eagle={built['eagle']}", f"prompts={built['prompts']}", "num_prompts=null", f"output_dir={out}"]
        assert decode([*args, "max_new_tokens=10"]) == 0
        return [json.loads(line)["tokens"] for line in (out / "outputs.jsonl").read_text().splitlines()]

    cpu = run(tmp_path / "cpu", "target.device=cpu")
    with VirtualGPUs(1):
        assert run(tmp_path / "gpu", "target.device=cuda:0") == cpu
    from specheads.decode import Decoder
    from specheads.shim import ModelSpec, load_pair

    with VirtualGPUs(2):
        pair = load_pair(ModelSpec(path=str(built["target"]), device="auto", device_map="auto"), None)
        with pytest.raises(UserError, match="policy=tree runs on the fused forward: .*sharded over several devices"):
            Decoder(pair, policy="tree", eagle=str(built["eagle"]))
