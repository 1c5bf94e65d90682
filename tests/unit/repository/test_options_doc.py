"""docs/options.md is generated from the option definitions and must match them."""

from tests.conftest import ROOT
from tritonllm.options import flag_of
from tritonllm.repository import options_doc
from tritonllm.repository.plan import engine_options


def test_options_doc_is_current():
    assert (ROOT / options_doc.DOC).read_text() == options_doc.render(), (
        "docs/options.md is stale: run `python -m tritonllm.repository.options_doc`"
    )


def test_every_engine_option_is_documented_with_its_help():
    text = options_doc.render()
    for option in engine_options():
        assert f"`{flag_of(option)}`" in text
        assert option.metadata["help"].split(";")[0] in text
