"""The public API at the top of the package (docs/python-api.md): small, light to import, every name resolves,
and the names before 0.2 still work with a warning that shows the new one."""

from __future__ import annotations

import subprocess
import sys

import pytest

import specheads

PUBLIC = {
    "load_pair",
    "ModelSpec",
    "SamplingConfig",
    "load_head",
    "load_eagle",
    "generate",
    "Decoder",
    "Result",
    "make_policy",
    "POLICIES",
    "Policy",
    "Round",
    "Verdict",
    "Settings",
    "register_policy",
    "Assistant",
}


def test_the_public_names_are_the_documented_ones_and_resolve():
    assert set(specheads.__all__) == PUBLIC
    from specheads.export import api, shim
    from specheads.hf import Assistant

    assert specheads.Decoder is api.Decoder and specheads.Result is shim.Result and specheads.Assistant is Assistant
    assert specheads.make_policy("sd", k=3).k == 3
    with pytest.raises(AttributeError):
        specheads.Engine  # noqa: B018 - internal: not part of the API
    page = api.__file__.rsplit("/export/", 1)[0] + "/docs/python-api.md"
    text = open(page, encoding="utf-8").read()
    assert [n for n in sorted(PUBLIC) if f"`{n}" not in text] == []


def test_import_specheads_stays_light():
    code = "import sys, specheads; print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_names_before_0_2_warn_and_still_work():
    import specheads.export as export

    with pytest.warns(FutureWarning, match="use Result"):
        assert export.Generation is specheads.Result
    with pytest.warns(FutureWarning, match="use make_policy"):
        build = export.build_policy
    assert build("sd", k=2).k == 2
    with pytest.warns(FutureWarning, match="write verify_top_k="):
        assert specheads.make_policy("topk_verify", top_k=3).top_k == 3

    with pytest.warns(FutureWarning, match="write emitter = 'draft'"):

        class Old(specheads.Policy):
            verifier = "draft"

    assert Old.emitter == "draft"
