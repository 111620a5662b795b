"""A local HTTP server on 127.0.0.1 for the tests of clients (the judge, the OpenAI-compatible backend): a
handler class served on a free port from a daemon thread, as a context manager."""

import http.server
import json
import threading


def send_json(handler: http.server.BaseHTTPRequestHandler, payload) -> None:
    """Writes `payload` as a 200 application/json reply."""
    data = json.dumps(payload).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class LocalServer:
    """Serves `handler` (a BaseHTTPRequestHandler subclass) at `url` (http://127.0.0.1:PORT/v1) inside `with`."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]):
        handler.log_message = lambda *a: None  # quiet
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
