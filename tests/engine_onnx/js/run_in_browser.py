"""Runs a `gated-qwen convert --to onnx` folder with Transformers.js in headless Chromium (page.html: its web build on
onnxruntime-web's WebAssembly backend) and prints what the page computed as JSON, for tests/engine_onnx (make test-onnx):

    python run_in_browser.py FOLDER '[[ids...], ...]' NEW_TOKENS

A server on loopback (127.0.0.1, a free port) serves the page, tests/engine_onnx/js/node_modules and the folder, and takes
the page's one POST of its result; Chromium (Debian's `chromium`, headless, its own empty profile) loads the page and
is ended once the result came, or after TIMEOUT_S.
"""

import json
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 600


class Handler(SimpleHTTPRequestHandler):
    result: list = []  # the page's one result
    done = threading.Event()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Handler.result.append(json.loads(body))
        self.send_response(204)
        self.end_headers()
        Handler.done.set()

    def log_message(self, *args):
        pass


def run(folder: Path, prompts: str, new_tokens: str) -> dict:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "no chromium on PATH (apt-get install chromium)"
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "js").symlink_to(HERE)
        (Path(root) / "models").symlink_to(folder.resolve().parent)
        server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=root))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = (f"http://127.0.0.1:{server.server_port}/js/page.html?model={quote(folder.name)}"
               f"&prompts={quote(prompts)}&new={new_tokens}")
        with tempfile.TemporaryDirectory() as profile:
            chrome = subprocess.Popen([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                       f"--user-data-dir={profile}", url], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            try:
                finished = Handler.done.wait(TIMEOUT_S)
            finally:
                chrome.terminate()
                chrome.wait(30)
                server.shutdown()
    assert finished, f"the page posted no result in {TIMEOUT_S} s"
    return Handler.result[0]


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]), sys.argv[2], sys.argv[3])))
