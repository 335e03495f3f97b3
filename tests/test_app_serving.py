"""Where the dashboard is served, and what it reads there (docs/dashboard.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.state import Inputs, model_spec, names_a_file, node_spec
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from tierwise.cli.dashboard import streamlit_command

PLANTED = "planted-value-from-a-server-file"
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512}


def test_dashboard_binds_localhost_unless_address_says_otherwise():
    command = streamlit_command(port=None, address=None, headless=True, extra=[])
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    command = streamlit_command(port=None, address="0.0.0.0", headless=True, extra=[])
    assert command[command.index("--server.address") + 1] == "0.0.0.0"


def test_beyond_localhost_the_model_field_reads_no_server_file(tmp_path):
    planted = tmp_path / "model.json"
    planted.write_text(json.dumps({"num_layers": PLANTED}))
    for value in (str(planted), "model.json", "../etc/model"):
        with pytest.raises(PlannerError, match="upload the model JSON") as err:
            model_spec(Inputs(model=value, server_files=False))
        assert PLANTED not in str(err.value)
    assert model_spec(Inputs(model="1T", server_files=False)) == resolve_model("1T")
    with pytest.raises(PlannerError, match="model file .*missing required key"):  # on localhost it is read, as by the CLI
        model_spec(Inputs(model=str(planted), server_files=True))


def test_names_a_file():
    assert names_a_file("x.JSON") and names_a_file("dir/x") and not names_a_file("1T") and not names_a_file("gpt3-175b")


def test_uploaded_model_and_hardware_documents(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    uploaded = model_spec(Inputs(model=None, model_document=json.dumps(LLAMA)))
    assert uploaded.num_params == resolve_model(str(path)).num_params
    assert model_spec(Inputs(model=None, model_document=json.dumps(LLAMA), seq_len=256)).seq_len == 256
    hardware = resolve_hardware("h200-x1").to_dict()
    assert node_spec("dgx-h100", (), json.dumps(hardware)) == resolve_hardware("h200-x1")
    with pytest.raises(PlannerError, match="uploaded model file is not JSON"):
        model_spec(Inputs(model=None, model_document="{nope"))
    with pytest.raises(PlannerError, match="uploaded hardware file must hold a JSON object"):
        node_spec("dgx-h100", (), "[1, 2]")


def test_inputs_round_trip_with_documents():
    inputs = Inputs(model=None, model_document=json.dumps(LLAMA), hardware_document="{}", server_files=True)
    assert Inputs.from_json(inputs.to_json()) == inputs


def test_the_page_served_beyond_localhost_refuses_a_server_path(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    planted = tmp_path / "model.json"
    planted.write_text(json.dumps({"num_layers": PLANTED}))
    monkeypatch.setenv("TIERWISE_HISTORY", str(tmp_path / "history.sqlite"))
    script = str(Path(__file__).resolve().parents[1] / "app" / "dashboard.py")
    at = AppTest.from_file(script, default_timeout=120).run()  # AppTest binds no loopback address
    at.sidebar.text_input(key="model").set_value(str(planted)).run()
    assert len(at.error) == 1 and "upload the model JSON" in at.error[0].value
    assert PLANTED not in at.error[0].value
