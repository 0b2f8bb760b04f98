"""``heads-decode`` end to end on tiny local models, the Python API, and every bad input."""

from __future__ import annotations

import json
import logging

import pytest
import yaml
from conftest import WORDS, acceptance_head_file, decode_args, make_tokenizer, tiny_llama

from specheads.decode import generate
from specheads.decode.decode_cli import main
from specheads.shim import ModelSpec, load_pair


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "the cat sat on a mat"},
        {"messages": [{"role": "user", "content": "why is the sun red"}]},
        {"id": "q3", "prompt": "one two three"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


_args = decode_args  # conftest


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("heads-decode: error: "), err
    return err[0]


def test_decode_end_to_end_writes_outputs(tiny_pair_dirs, prompts_file, tmp_path):
    sd_dir, ar_dir = tmp_path / "sd", tmp_path / "ar"
    assert main(_args(tiny_pair_dirs, prompts_file, sd_dir, "sd.k=3")) == 0
    assert main(_args(tiny_pair_dirs, prompts_file, ar_dir, "policy=ar")) == 0
    for d in (sd_dir, ar_dir):
        assert {"outputs.jsonl", "metrics.jsonl", "metrics.json", "config.yaml", "manifest.json"} <= {
            p.name for p in d.iterdir()
        }
    sd = [json.loads(x) for x in (sd_dir / "outputs.jsonl").read_text().splitlines()]
    ar = [json.loads(x) for x in (ar_dir / "outputs.jsonl").read_text().splitlines()]
    assert [r["id"] for r in sd] == ["prompts-0", "prompts-1", "q3"]
    assert [r["tokens"] for r in sd] == [r["tokens"] for r in ar]  # greedy SD is exact
    summary = json.loads((sd_dir / "metrics.json").read_text())
    for key in (
        "new_tokens",
        "target_calls",
        "draft_forwards",
        "accepted_per_call",
        "tokens_per_call",
        "discard_rate",
        "verification_rate",
        "wall_time",
        "tokens_per_s",
    ):
        assert key in summary
    assert summary["prompts"] == 3 and summary["k"] == 3
    assert len((sd_dir / "metrics.jsonl").read_text().splitlines()) == 3
    cfg = yaml.safe_load((sd_dir / "config.yaml").read_text())
    assert cfg["sd"]["k"] == 3 and cfg["target"]["path"] == str(tiny_pair_dirs[0])
    manifest = json.loads((sd_dir / "manifest.json").read_text())
    assert manifest["target"]["fingerprint"].startswith("sha256:")


def test_stream_prints_completions(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "s", "stream=true", "num_prompts=1")) == 0
    out = capsys.readouterr().out
    first = json.loads((tmp_path / "s" / "outputs.jsonl").read_text().splitlines()[0])
    assert "### prompts-0" in out and first["completion"].strip() in out


def test_sampled_decode_is_seeded(tiny_pair_dirs, prompts_file, tmp_path):
    runs = []
    for name in ("a", "b"):
        assert (
            main(
                _args(
                    tiny_pair_dirs,
                    prompts_file,
                    tmp_path / name,
                    "sampling.do_sample=true",
                    "sampling.top_p=0.9",
                    "seed=5",
                )
            )
            == 0
        )
        runs.append([json.loads(x)["tokens"] for x in (tmp_path / name / "outputs.jsonl").read_text().splitlines()])
    assert runs[0] == runs[1]


def test_another_seed_gives_other_draws(tiny_pair_dirs, prompts_file, tmp_path):
    """The run's seed reaches the draws (a CPU generator keeps only a seed's low 32 bits)."""
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"s{seed}"
        assert main(_args(tiny_pair_dirs, prompts_file, out, "sampling.do_sample=true", f"seed={seed}")) == 0
        runs.append([json.loads(x)["tokens"] for x in (out / "outputs.jsonl").read_text().splitlines()])
    assert runs[0] != runs[1]


def test_python_api(tiny_pair_dirs):
    t, d = tiny_pair_dirs
    pair = load_pair(ModelSpec(path=str(t), device="cpu"), ModelSpec(path=str(d), device="cpu"))
    [res] = generate(pair, "the dog ran up", policy="sd", k=4, max_new_tokens=10)
    [ref] = generate(pair, "the dog ran up", policy="ar", max_new_tokens=10)
    assert res.tokens == ref.tokens and len(res.tokens) == 10 and res.stats.target_calls >= 1
    assert isinstance(res.text, str)


def test_help_lists_recipes_and_fields(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for needle in ("quickstart", "target.path", "sampling.top_p", "max_new_tokens", "policy"):
        assert needle in out


def test_missing_model_path(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    args = _args(tiny_pair_dirs, prompts_file, tmp_path / "o") + [f"target.path={tmp_path / 'nope'}"]
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert "target.path" in line and "does not exist" in line


def test_unknown_recipe(capsys):
    assert main(["recipe=quickstrat"]) == 2
    assert "did you mean 'quickstart'" in _one_error_line(capsys)


def test_unknown_key(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "o", "max_new_token=4")) == 2
    assert "max_new_tokens" in _one_error_line(capsys)


def test_bad_values_reported_together(capsys):
    assert main(["sd.k=abc", "sampling.top_p=x"]) == 2
    line = _one_error_line(capsys)
    assert "sd.k" in line and "sampling.top_p" in line


def test_invalid_settings(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    args = _args(
        tiny_pair_dirs, prompts_file, tmp_path / "o", "sampling.do_sample=true", "sampling.temperature=0", "policy=nope"
    )
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert "temperature" in line and "policy='nope'" in line
    args = _args(
        tiny_pair_dirs, prompts_file, tmp_path / "o", "sd.k=0", "sampling.do_sample=true", "sampling.temperature=0"
    )
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert "sd.k=0 must be >= 1" in line and "temperature" in line


def test_mismatched_tokenizers(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    other_tok = make_tokenizer(WORDS[::-1] + ["zebra"])
    other = tmp_path / "other_draft"
    tiny_llama(len(other_tok)).save_pretrained(other)
    other_tok.save_pretrained(other)
    args = _args(tiny_pair_dirs, prompts_file, tmp_path / "o") + [f"draft.path={other}"]
    capsys.readouterr()
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert "tokenizers differ" in line and "tli" in line and "slem" in line


def test_empty_prompt_file(tiny_pair_dirs, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(_args(tiny_pair_dirs, empty, tmp_path / "o")) == 2
    assert "empty" in _one_error_line(capsys)


def test_prompt_longer_than_context_is_truncated_with_warning(tiny_pair_dirs, tmp_path, caplog):
    t, _ = tiny_pair_dirs
    tok = make_tokenizer()
    short_target, short_draft = tmp_path / "st", tmp_path / "sd"
    for path, seed in ((short_target, 0), (short_draft, 1)):
        tiny_llama(len(tok), seed=seed, max_positions=48).save_pretrained(path)
        tok.save_pretrained(path)
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps({"prompt": " ".join(WORDS * 3)}) + "\n")
    out = tmp_path / "o"
    with caplog.at_level(logging.WARNING):
        assert main(_args((short_target, short_draft), long_prompt, out)) == 0
    assert any("exceed the context" in r.getMessage() for r in caplog.records)
    row = json.loads((out / "outputs.jsonl").read_text())
    assert row["truncated_prompt_tokens"] > 0 and len(row["tokens"]) == 12


def test_output_dir_with_another_run_is_refused(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(_args(tiny_pair_dirs, prompts_file, out, "num_prompts=1")) == 0
    capsys.readouterr()
    assert main(_args(tiny_pair_dirs, prompts_file, out, "num_prompts=1", "sd.k=2")) == 2
    assert "overwrite=true" in _one_error_line(capsys)
    assert main(_args(tiny_pair_dirs, prompts_file, out, "num_prompts=1", "sd.k=2", "overwrite=true")) == 0


def test_specdecpp_policy_with_exported_head(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    path = acceptance_head_file(tiny_pair_dirs, tmp_path / "h.safetensors")
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "pp", "policy=specdecpp", f"specdecpp.head={path}")) == 0
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "ar", "policy=ar")) == 0
    rows = [
        [json.loads(x)["tokens"] for x in (tmp_path / n / "outputs.jsonl").read_text().splitlines()]
        for n in ("pp", "ar")
    ]
    assert rows[0] == rows[1]
    summary = json.loads((tmp_path / "pp" / "metrics.json").read_text())
    assert summary["threshold"] == 0.6 and summary["k_max"] == 20
    capsys.readouterr()
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "nohead", "policy=specdecpp")) == 2
    assert "needs its head: specdecpp.head=" in _one_error_line(capsys)


def test_interrupted_run_resumes_to_the_same_outputs(tiny_pair_dirs, prompts_file, tmp_path, caplog):
    sampled = ("sampling.do_sample=true", "seed=3")
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_args(tiny_pair_dirs, prompts_file, full, *sampled)) == 0
    assert main(_args(tiny_pair_dirs, prompts_file, cut, *sampled)) == 0
    lines = (cut / "outputs.jsonl").read_text().splitlines(keepends=True)
    (cut / "outputs.jsonl").write_text(lines[0] + lines[1][:15])  # killed while writing row 2
    with caplog.at_level(logging.INFO):
        assert main(_args(tiny_pair_dirs, prompts_file, cut, *sampled)) == 0
    assert any("resuming: 1 of 3" in r.getMessage() for r in caplog.records)
    rows = {
        n: [json.loads(x) for x in (d / "outputs.jsonl").read_text().splitlines()]
        for n, d in (("full", full), ("cut", cut))
    }
    assert [(r["id"], r["tokens"]) for r in rows["cut"]] == [(r["id"], r["tokens"]) for r in rows["full"]]
    assert len((cut / "metrics.jsonl").read_text().splitlines()) == 3
    assert json.loads((cut / "metrics.json").read_text())["new_tokens"] == sum(len(r["tokens"]) for r in rows["full"])


def test_each_policys_threshold_has_its_own_name(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    """Each policy's threshold has its own name (h, eta, delta, T, tau) in its section, checked there."""
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "own", "policy=fsd", "fsd.T=0.3", "fsd.k=3")) == 0
    assert json.loads((tmp_path / "own" / "metrics.json").read_text())["threshold"] == 0.3
    assert yaml.safe_load((tmp_path / "own" / "config.yaml").read_text())["fsd"]["T"] == 0.3
    capsys.readouterr()
    assert (
        main(_args(tiny_pair_dirs, prompts_file, tmp_path / "tau", "policy=confidence_stop", "confidence_stop.tau=1.5"))
        == 2
    )
    assert "confidence_stop.tau=1.5 must be in [0, 1]" in _one_error_line(capsys)


@pytest.mark.parametrize(
    "flat, nested", [("k=3", "sd.k"), ("threshold=0.3", None), ("delta=0.5", "judge.delta"), ("T=0.3", "fsd.T")]
)
def test_a_setting_outside_its_policys_section_is_a_one_line_error(
    tiny_pair_dirs, prompts_file, tmp_path, capsys, flat, nested
):
    """No release had flat settings (``k=3``): one is an unknown key, and the error names the spelling to use."""
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "x", flat)) == 2
    err = _one_error_line(capsys)
    assert f"unknown key {flat.split('=')[0]!r}" in err and (nested is None or nested in err)


def test_help_lists_each_policys_settings(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for key in ("judge.delta", "specdecpp.h", "fsd.T", "confidence_stop.tau", "sprinter.eta", "slrs.budget"):
        assert f"  {key}: " in text, key


def test_one_rule_per_setting_for_both_command_lines():
    """A setting's rule is written once, in its policy: heads-decode reports one value, heads-eval a swept list."""
    from specheads.decode.api import make_policy
    from specheads.shim.policies import POLICIES, Judge, Policy

    assert Judge.Settings(delta=1.5).problems() == ["delta=1.5 must be in [0, 1]"]
    assert Judge.Settings.sweep("delta", "deltas", [0.5, 1.5]) == ["deltas=[0.5, 1.5]: every delta must be in [0, 1]"]
    for name in ("ar", "draft", "sd", "topk_verify", "confidence_stop", "tli", "slem"):  # one type, no head to load
        policy = make_policy(name, pair=None)
        assert isinstance(policy, Policy) and type(policy) is POLICIES[name]


def test_batched_decode_writes_what_batch_one_writes(tiny_pair_dirs, prompts_file, tmp_path):
    """batch_size=2 over 3 prompts (one row joins later): each prompt's tokens and counts are batch 1's,
    sampled too (each prompt draws from its own seeded stream); a resumed batched run keeps what was done."""

    def rows(out):
        return {r["index"]: r for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}

    for extra in ([], ["sampling.do_sample=true"]):
        one, two = tmp_path / f"b1{len(extra)}", tmp_path / f"b2{len(extra)}"
        assert main(_args(tiny_pair_dirs, prompts_file, one, "sd.k=3", *extra)) == 0
        assert main(_args(tiny_pair_dirs, prompts_file, two, "sd.k=3", "batch_size=2", *extra)) == 0
        a, b = rows(one), rows(two)
        assert sorted(b) == [0, 1, 2]
        for i in a:
            keys = ("tokens", "completion", "id")
            assert {k: b[i][k] for k in keys} == {k: a[i][k] for k in keys}
            same = ("new_tokens", "target_calls", "draft_forwards", "accepted", "target_pass_sizes")
            assert {k: b[i]["stats"][k] for k in same} == {k: a[i]["stats"][k] for k in same}
        summary = json.loads((two / "metrics.json").read_text())
        assert summary["batch_size"] == 2 and summary["aggregate_tokens_per_s"] > 0
    lines = (two / "outputs.jsonl").read_text().splitlines()
    (two / "outputs.jsonl").write_text(lines[0] + "\n")  # as if killed after the first finished prompt
    assert main(_args(tiny_pair_dirs, prompts_file, two, "sd.k=3", "batch_size=2", "sampling.do_sample=true")) == 0
    assert rows(two) == {i: r for i, r in rows(tmp_path / "b21").items()} | {
        json.loads(lines[0])["index"]: json.loads(lines[0])
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        (["batch_size=0"], "batch_size=0 must be >= 1"),
        (["batch_size=2", "stream=true"], "stream=true prints one completion at a time"),
        (["batch_size=2", "policy=slem"], "runs at batch 1 only"),
        (["batch_size=2", "fused_forward=false"], "fused forward"),
    ],
)
def test_batched_decode_refusals(tiny_pair_dirs, prompts_file, tmp_path, capsys, extra, message):
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "out", *extra)) == 2
    assert message in _one_error_line(capsys)
