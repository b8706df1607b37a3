import json

import nbformat
import pytest
from nbclient import NotebookClient

from mtp.drafters.heads import MedusaHeads
from tests.conftest import DATA, ROOT, save_random_heads


@pytest.mark.slow
def test_the_evaluation_notebook_runs_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    path, _, _ = save_random_heads(tmp_path, "shared")
    heads = MedusaHeads.from_pretrained(path)
    heads.config.calibration = [[0.5, 0.2, 0.1] + [0.01] * 7] * heads.config.num_heads
    heads.save_config(path)
    bench = tmp_path / "bench.json"
    settings = {
        "MTP_HEADS": path,
        "MTP_QUESTIONS": str(DATA / "mt_bench.jsonl"),
        "MTP_BENCH": str(bench),
        "MTP_LIMIT": "2",
        "MTP_MAX_NEW_TOKENS": "8",
        "MTP_SIZES": "1,2,4",
        "MTP_CACHE": str(tmp_path / "cache"),
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    notebook = nbformat.read(ROOT / "notebooks" / "evaluate.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert sum(output.output_type == "display_data" and "image/png" in output.data for output in outputs) == 4
    text = "".join(output.get("text", "") for output in outputs)
    assert "| overall | 2 |" in text and "mtp.tools.sizing's choice on this machine" in text
    assert json.loads(bench.read_text())["summary"]["overall"]["mismatches"]["mtp"] == 0  # it ran the benchmark itself
