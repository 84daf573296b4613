"""A Hugging Face hub on 127.0.0.1 serving one model directory as a repository (one
revision, `main`), speaking the three calls huggingface_hub's snapshot_download
makes: the repository's info, its file tree, and each file's resolve URL (HEAD for
its metadata, GET for its bytes). Point HF_ENDPOINT at `url` to exercise the real
download path with no network."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self, repo_id: str, directory: Path, sha: str = "a" * 40):
        self.repo_id, self.directory, self.sha = repo_id, directory, sha
        self.files = {p.relative_to(directory).as_posix(): p
                      for p in sorted(directory.rglob("*")) if p.is_file()}
        self.requests: list[str] = []  # "METHOD path", in order
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _etag(self, name: str) -> str:
        return hashlib.sha1(self.files[name].read_bytes()).hexdigest()

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(f"{h.command} {path}")
        api = f"/api/models/{self.repo_id}/"
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(api + "revision/"):
            siblings = [{"rfilename": name} for name in self.files]
            return self._json(h, {"id": self.repo_id, "modelId": self.repo_id,
                                  "sha": self.sha, "siblings": siblings}, body)
        if path.startswith(api + "tree/"):
            tree = [{"type": "file", "path": name, "size": p.stat().st_size,
                     "oid": self._etag(name)} for name, p in self.files.items()]
            return self._json(h, tree, body)
        if path.startswith(resolve):
            name = path[len(resolve):].split("/", 1)[1]
            if name in self.files:
                data = self.files[name].read_bytes()
                h.send_response(200)
                h.send_header("Content-Length", str(len(data)))
                h.send_header("ETag", f'"{self._etag(name)}"')
                h.send_header("X-Repo-Commit", self.sha)
                h.end_headers()
                if body:
                    h.wfile.write(data)
                return None
        h.send_response(404)
        h.send_header("X-Error-Code", "EntryNotFound")
        h.send_header("Content-Length", "0")
        h.end_headers()
        return None

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, value, body: bool) -> None:
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)
