"""The instance the process-runtime tests run: answers GET /health (200) and /init.json (the
instance's blockInitData) on 127.0.0.1:$AIOS_PORT until it is stopped."""

import http.server
import os


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = {"/health": b"ok", "/init.json": os.environ.get("blockInitData", "").encode()}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"not found")

    def log_message(self, *args: object) -> None:
        pass


http.server.HTTPServer(("127.0.0.1", int(os.environ["AIOS_PORT"])), Handler).serve_forever()
