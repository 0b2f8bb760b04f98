"""The public API at the top of the package (docs/python-api.md): small, light to import, every name resolves,
and no alias kept for spellings no release had."""

from __future__ import annotations

import subprocess
import sys

import pytest

import specheads
from specheads.errors import UserError

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
    from specheads import shim
    from specheads.decode import api
    from specheads.hf import Assistant

    assert specheads.Decoder is api.Decoder and specheads.Result is shim.Result and specheads.Assistant is Assistant
    assert specheads.make_policy("sd", k=3).k == 3
    with pytest.raises(AttributeError):
        specheads.Engine  # noqa: B018 - internal: not part of the API
    page = api.__file__.rsplit("/decode/", 1)[0] + "/docs/python-api.md"
    text = open(page, encoding="utf-8").read()
    assert [n for n in sorted(PUBLIC) if f"`{n}" not in text] == []


def test_import_specheads_stays_light():
    code = "import sys, specheads; print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_name_is_kept_for_a_release_that_never_happened():
    """0.2 is the first release: the spellings of its development (Generation, build_policy, top_k=, a policy's
    verifier attribute) are gone, not aliased."""
    import specheads.decode as export

    for name in ("Generation", "build_policy", "fit_context", "format_prompt"):
        assert not hasattr(export, name), name
    with pytest.raises(UserError, match="no setting top_k"):
        specheads.make_policy("topk_verify", top_k=3)
    assert specheads.make_policy("topk_verify", verify_top_k=3).top_k == 3
