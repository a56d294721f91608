"""JupyterLab as users get it: `make notebooks` pairs each jupytext notebook with an .ipynb, `make lab` serves them
with the `hqlab` kernel, and an edit saved in JupyterLab lands in the .py file (the source of truth).

These run the Makefile's own targets on a copy of a real notebook in a temporary folder (NOTEBOOK_DIR), with this
test run's venv (VENV); make is told not to reinstall it (-o its stamp).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jupytext
import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
BIN = Path(sys.executable).parent
NOTEBOOK = REPO / "notebooks" / "kernels.py"  # the smallest notebook
EDIT = "answer = 42  # typed in JupyterLab\n"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make (the targets under test)")


def _make(*args: str) -> list[str]:
    return ["make", "--no-print-directory", "-C", str(REPO), "-o", f"{VENV}/.hqlab-installed", f"VENV={VENV}", *args]


# a make of its own, not a sub-make of the `make test` that may be running these tests
_ENV = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def _copy_notebook(folder: Path) -> Path:
    """A copy of the notebook, with the repository's jupytext.toml, in `folder`."""
    shutil.copy(REPO / "jupytext.toml", folder)
    return Path(shutil.copy(NOTEBOOK, folder / NOTEBOOK.name))


def _make_notebooks(folder: Path) -> Path:
    run = subprocess.run(_make("notebooks", f"NOTEBOOK_DIR={folder}"), capture_output=True, text=True, timeout=120,
                         env=_ENV)
    assert run.returncode == 0, run.stdout + run.stderr
    return folder / NOTEBOOK.with_suffix(".ipynb").name


def _first_code_cell(nb: dict) -> dict:
    return next(c for c in nb["cells"] if c["cell_type"] == "code")


def _source(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def test_every_notebook_is_paired_and_names_the_hqlab_kernel():
    """A notebook's own header overrides jupytext.toml: one that names only py:percent would make JupyterLab refuse
    to save its .ipynb, and one naming another kernel would open with that kernel."""
    from jupytext.config import find_jupytext_configuration_file

    assert Path(find_jupytext_configuration_file(str(REPO / "notebooks"))) == REPO / "jupytext.toml"
    assert 'formats = "ipynb,py:percent"' in (REPO / "jupytext.toml").read_text()
    notebooks = sorted((REPO / "notebooks").glob("*.py"))
    assert notebooks
    for py in notebooks:
        meta = jupytext.read(py).metadata
        assert meta.get("jupytext", {}).get("formats") == "ipynb,py:percent", py.name
        assert meta.get("kernelspec", {}).get("name") == "hqlab", py.name


def test_make_notebooks_pairs_and_edits_flow_back_to_the_py(tmp_path):
    py = _copy_notebook(tmp_path)
    ipynb = _make_notebooks(tmp_path)
    before = py.read_text()
    assert before == NOTEBOOK.read_text()  # make notebooks never rewrites the sources
    nb = json.loads(ipynb.read_text())
    assert nb["metadata"]["jupytext"]["formats"] == "ipynb,py:percent"
    assert nb["metadata"]["kernelspec"]["name"] == "hqlab"

    # an edit and an output saved in the .ipynb, synced as JupyterLab's jupytext does on save
    cell = _first_code_cell(nb)
    old = _source(cell)
    cell["source"] = EDIT + old
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "an output kept in the .ipynb\n"}]
    ipynb.write_text(json.dumps(nb))
    later = time.time() + 2
    os.utime(ipynb, (later, later))
    run = subprocess.run([str(BIN / "jupytext"), "--sync", str(ipynb)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert py.read_text() == before.replace(old, EDIT + old, 1)  # the edit, and nothing else

    # make notebooks again (say after a pull): cells from the .py, the outputs of the .ipynb kept
    after = py.read_text()
    _make_notebooks(tmp_path)
    assert py.read_text() == after
    cell = _first_code_cell(json.loads(ipynb.read_text()))
    assert _source(cell).startswith(EDIT)
    assert "".join(cell["outputs"][0]["text"]) == "an output kept in the .ipynb\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, token: str, path: str, method: str = "GET", body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, method=method, headers={"Authorization": f"token {token}",
                                                                      "Content-Type": "application/json"},
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read()
    return json.loads(text) if text else {}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`make lab` on a folder holding one notebook, headless, on a free loopback port with a token."""
    folder = tmp_path_factory.mktemp("lab")
    home = tmp_path_factory.mktemp("jupyter-home")
    _copy_notebook(folder)
    port, token = _free_port(), secrets.token_hex(16)
    args = f"--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port={port} --ServerApp.port_retries=0 " \
           f"--IdentityProvider.token={token}"
    env = {**_ENV, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces")}
    log = home / "lab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_make("lab", f"NOTEBOOK_DIR={folder}", f"LAB_ARGS={args}"), stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"make lab exited ({proc.returncode}) before the server answered:\n{log.read_text()[-3000:]}")
            try:
                _api(base, token, "/api/status")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within 60 s:\n{log.read_text()[-3000:]}")
                time.sleep(0.3)
        yield base, token, folder
        _api(base, token, "/api/shutdown", "POST")
        proc.wait(timeout=30)
        assert proc.returncode == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def test_lab_lists_the_hqlab_kernel_and_refuses_no_token(lab):
    base, token, _ = lab
    specs = _api(base, token, "/api/kernelspecs")["kernelspecs"]
    assert "hqlab" in specs, sorted(specs)
    argv = specs["hqlab"]["spec"]["argv"]
    assert Path(argv[0]).parent == BIN  # this venv's Python, which imports hqlab
    with pytest.raises(urllib.error.HTTPError) as e:
        _api(base, "wrong-token", "/api/kernelspecs")
    assert e.value.code == 403


def test_lab_opens_the_paired_notebook_and_saves_back_to_the_py(lab):
    base, token, folder = lab
    py = folder / NOTEBOOK.name
    before = py.read_text()
    name = NOTEBOOK.with_suffix(".ipynb").name
    model = _api(base, token, f"/api/contents/{name}?type=notebook&content=1")
    nb = model["content"]
    assert nb["metadata"]["kernelspec"]["name"] == "hqlab"
    cell = _first_code_cell(nb)
    old = _source(cell)
    cell["source"] = EDIT + old
    _api(base, token, f"/api/contents/{name}", "PUT", {"type": "notebook", "format": "json", "content": nb})
    assert py.read_text() == before.replace(old, EDIT + old, 1)
    saved = json.loads((folder / name).read_text())
    assert _source(_first_code_cell(saved)).startswith(EDIT)
