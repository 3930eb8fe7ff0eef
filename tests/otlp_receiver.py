"""An OTLP/HTTP traces receiver on a free loopback port: it decodes each export (protobuf, with
opentelemetry-proto, as a collector does) and keeps the spans. Used by tests/test_tracing.py and
benchmarks/serving.py --otlp."""

from __future__ import annotations

import http.server
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)


class Receiver:
    def __init__(self):
        self.spans: list = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def trace(self, trace_id: bytes) -> list:
        """The spans received of one trace."""
        return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
