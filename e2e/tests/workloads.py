"""Manifests for workload scenarios: a tiny HTTP server that runs the same locally and in a real pod."""
from __future__ import annotations

from typing import Any

# Serves "<pod name> <VERSION>" on every path, exits on /exit, ends cleanly on SIGTERM. Binds the pod IP
# (the local kubelet gives each pod its own loopback address; a real pod may bind it too).
SERVER = r"""
import http.server, os, signal, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/exit":
            os._exit(3)
        body = ("%s %s\n" % (os.environ.get("HOSTNAME"), os.environ.get("VERSION", "v1"))).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, fmt, *args):
        print(fmt % args, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
server = http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8080), Handler)
print("serving on %s:8080" % os.environ["POD_IP"], flush=True)
server.serve_forever()
"""

IMAGE = "python:3.11-slim"


def web_deployment(name: str = "web", replicas: int = 1, version: str = "v1", max_surge: int | str = 1,
                   max_unavailable: int | str = 0, readiness_delay: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": max_surge, "maxUnavailable": max_unavailable}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "server", "image": IMAGE, "command": ["python", "-c", SERVER],
                        "env": [{"name": "VERSION", "value": version},
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                        "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                                           "initialDelaySeconds": readiness_delay, "periodSeconds": 1,
                                           "failureThreshold": 2},
                        "livenessProbe": {"httpGet": {"path": "/alive", "port": 8080}, "periodSeconds": 2,
                                          "failureThreshold": 3},
                    }],
                },
            },
        },
    }


def web_service(name: str = "web") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
