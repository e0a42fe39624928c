"""A minimal OTLP/HTTP trace receiver (protobuf over HTTP, as the SDK's OTLPSpanExporter sends), on loopback in a
thread: what the tracing test and benchmark export to, decoding each export with opentelemetry-proto."""

from __future__ import annotations

import http.server
import threading


class OTLPReceiver(http.server.ThreadingHTTPServer):
    """Collects every exported span in `spans`; the endpoint is `url`."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with receiver.lock:
                    for rs in req.resource_spans:
                        for ss in rs.scope_spans:
                            receiver.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}/v1/traces"
