"""Shared by the proxy benches: nginx as a native streaming forwarder, started and stopped by the bench.

Not part of the daemon (which never depends on nginx): a yardstick for what a forwarder written in C
costs per token on the same machine, beside the bare Python relay and the daemon's proxy. One worker
process (so its CPU compares with one Python process), `proxy_buffering off` (each upstream read
written on at once, as the proxy does), HTTP/1.1 keep-alive to the upstream, no access log.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

CONFIG = """\
worker_processes 1;
daemon off;
master_process on;
{user}pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    upstream up {{
        server 127.0.0.1:{up_port};
        keepalive 1024;
        keepalive_requests 1000000;
        keepalive_timeout 75s;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if os.access(p, os.X_OK)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nginx(up_port: int, tmp: Path) -> tuple[subprocess.Popen, str] | str:
    """(the master process, its URL), or why not (a sentence to print). The worker is the master's only
    child: CPU meters that sum a process and its children read the worker's time (the master idles)."""
    binary = nginx_binary()
    if binary is None:
        return "nginx not installed (apt-get install nginx-light): skipped"
    tmp = Path(tmp) / "nginx"
    tmp.mkdir(parents=True, exist_ok=True)
    # As root, nginx would run its worker as `nobody`, which cannot enter the bench's private temp dir.
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
    for _attempt in range(3):  # the free port may be taken between the probe and nginx's bind
        port = _free_port()
        (tmp / "nginx.conf").write_text(CONFIG.format(user=user, tmp=tmp, up_port=up_port, port=port))
        proc = subprocess.Popen([binary, "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(tmp / "nginx.conf")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return proc, f"http://127.0.0.1:{port}"
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
    log = (tmp / "error.log").read_text(errors="replace")[-500:] if (tmp / "error.log").exists() else ""
    return f"nginx ({binary}) did not start: {log.strip() or 'no error log'}"


def stop_nginx(proc: subprocess.Popen) -> None:
    """SIGTERM is nginx's fast shutdown: the master stops its worker and exits."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
