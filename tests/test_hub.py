"""Models by Hugging Face Hub id, on local data only: a test-built cache in the Hub's own layout
(``models--ORG--NAME/blobs``, ``snapshots/<commit>`` of links into the blobs, ``refs/main``) holding a tiny
random model, loaded by id in offline mode through the library, and through the CLI with the real
environment variables. Nothing here reaches the network: offline mode is on throughout, and the CLI runs
also point HF_ENDPOINT at a closed local port, so an attempt would fail at once instead of downloading."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from marspec.api import Decoder
from marspec.errors import MarspecError
from marspec.models import resolve_model_dir
from marspec.models.hub import is_hub_id, names_hub_model
from marspec.selftest import save_tiny_model, tiny_model

REPO = "marspec-test/tiny-qwen2"
NO_WEIGHTS = "marspec-test/config-only"
COMMIT = hashlib.sha1(b"marspec tiny model").hexdigest()
PROMPT = "def add(a, b):"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def add_to_hub_cache(cache: Path, repo_id: str, files: Path) -> Path:
    """Lay the files of folder ``files`` out in ``cache`` as huggingface_hub does after a download of
    ``repo_id``'s main revision: content-addressed blobs, a snapshot folder of relative links to them,
    and refs/main naming the snapshot's commit. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    model = save_tiny_model(root / "staging", tiny_model(seed=3))
    cache = root / "hub"
    add_to_hub_cache(cache, REPO, model)
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text((model / "config.json").read_text())
    add_to_hub_cache(cache, NO_WEIGHTS, root / "config-only")
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch) -> Path:
    """huggingface_hub configured as HF_HUB_OFFLINE=1 HF_HUB_CACHE=<the test cache> would configure it
    (it reads them once, when imported: this process imported it long ago). One torch thread while
    here: the models are tiny, and on a busy machine more threads only wait for each other."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield hub_cache
    torch.set_num_threads(threads)


def snapshot_of(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / COMMIT


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(offline):
    assert resolve_model_dir(REPO) == snapshot_of(offline, REPO)


def test_decoder_loads_a_hub_id_offline_as_the_same_model_as_its_folder(offline):
    by_id = Decoder(REPO, None, device="cpu")
    assert by_id.target.name == REPO
    by_folder = Decoder(str(snapshot_of(offline, REPO)), None, device="cpu")
    options = {"rule": "plain", "max_new_tokens": 12, "chat": False}
    tokens = by_id.generate(PROMPT, **options).token_ids
    assert len(tokens) == 12
    assert tokens == by_folder.generate(PROMPT, **options).token_ids


def test_a_missing_hub_id_offline_is_one_line_saying_what_to_do(offline):
    with pytest.raises(MarspecError) as caught:
        resolve_model_dir("marspec-test/not-cached")
    message = str(caught.value)
    assert "\n" not in message
    assert "'marspec-test/not-cached'" in message and "HF_HUB_OFFLINE" in message
    assert str(offline) in message


@pytest.mark.parametrize("bad", ["marspec-test/two--dashes", "marspec-test/ends-with.git"])
def test_a_malformed_hub_id_is_refused_with_the_hubs_reason(offline, bad):
    with pytest.raises(MarspecError, match="not a valid Hugging Face Hub id") as caught:
        resolve_model_dir(bad)
    assert "\n" not in str(caught.value)


def test_a_hub_snapshot_without_safetensors_is_refused(offline):
    with pytest.raises(MarspecError, match="no safetensors weights"):
        resolve_model_dir(NO_WEIGHTS)


def test_what_is_a_hub_id_and_what_is_a_path(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    for not_an_id in ("qwen", "./org/name", "~/org", "/abs/path", "a/b/c", "org/model.gguf", "org/a b"):
        assert not is_hub_id(not_an_id), not_an_id
    monkeypatch.chdir(tmp_path)
    assert names_hub_model("org/name") and not names_hub_model(Path("org/name"))  # a Path is a path
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not names_hub_model("org/name")  # a local folder of that name wins, as in transformers


@pytest.mark.parametrize(
    ("name", "says"),
    [("no-such-model", "unknown model 'no-such-model'"), ("./no/such/folder", "does not exist")],
)
def test_names_that_are_no_hub_id_never_reach_the_hub(offline, name, says):
    with pytest.raises(MarspecError, match=says) as caught:
        resolve_model_dir(name)
    assert "Hub id ORG/NAME" in str(caught.value)  # the message offers the Hub form too


class _HubErrors(http.server.BaseHTTPRequestHandler):
    """The Hub's HTTP answers for a repository that does not exist (404 RepoNotFound) and for a gated
    one (403 GatedRepo), the headers huggingface_hub turns into its exceptions."""

    def do_GET(self) -> None:
        code, error = (403, "GatedRepo") if "gated" in self.path else (404, "RepoNotFound")
        body = b'{"error": "test"}'
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def online(tmp_path, monkeypatch) -> str:
    """huggingface_hub online (HF_HUB_OFFLINE unset) against a local server giving the Hub's error
    answers, with an empty cache; yields the server's address."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubErrors)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    yield endpoint
    server.shutdown()
    thread.join()


@pytest.mark.parametrize(
    ("repo_id", "says"),
    [
        ("marspec-test/missing", "does not exist or is private: check the id on {endpoint}/"),
        ("marspec-test/gated", "is gated: accept its terms on {endpoint}/marspec-test/gated"),
    ],
)
def test_hub_refusals_are_one_line_saying_what_to_do(online, repo_id, says):
    with pytest.raises(MarspecError) as caught:
        resolve_model_dir(repo_id)
    message = str(caught.value)
    assert says.format(endpoint=online) in message and "HF_TOKEN" in message
    assert "\n" not in message


def test_an_unreachable_hub_without_a_cached_copy_is_one_line(online, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    with pytest.raises(MarspecError, match="cannot reach the Hugging Face Hub") as caught:
        resolve_model_dir("marspec-test/unreachable")
    assert "HF_HUB_OFFLINE=1" in str(caught.value) and "\n" not in str(caught.value)


def run_cli(cache: Path, *args: str) -> subprocess.CompletedProcess:
    """``marspec ARGS`` in a fresh process, configured only through the environment, as a user would."""
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # a closed port: any request would fail at once
    }
    command = [sys.executable, "-m", "marspec.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_cli_generates_with_a_hub_id_offline(offline):
    expected = Decoder(str(snapshot_of(offline, REPO)), None, device="cpu").generate(
        PROMPT, rule="plain", max_new_tokens=8, chat=False
    )
    out = run_cli(
        offline,
        *("generate", PROMPT, "--target", REPO, "--draft", REPO, "--rule", "strict"),
        *("--max-new-tokens", "8", "--device", "cpu", "--threads", "1", "--json"),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["token_ids"] == expected.token_ids


def test_cli_a_missing_hub_id_exits_2_with_one_line(hub_cache):
    out = run_cli(hub_cache, "generate", PROMPT, "--target", "marspec-test/not-cached", "--draft", "none")
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "HF_HUB_OFFLINE" in lines[0] and "not-cached" in lines[0], out.stderr
