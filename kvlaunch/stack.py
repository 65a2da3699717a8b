"""The one launcher of a picker behind a real Envoy, for ``make run``, the benchmarks and the
tests: the picker (``python -m picker``) on free loopback ports, and Envoy with a config rendered
by ``deploy/envoy/render.py`` (or given whole).

    procs = Procs(run_dir)
    st = Stack(procs, upstreams=[8001, 8002])
    st.start_picker("--policy", "cost")
    st.start_envoy("--upstream", "pool", "--endpoints", ",".join(st.addresses))
    ...                       # send to st.url
    procs.stop()
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import secrets
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from picker.serving.tls import CERT, KEY, LocalPki, local_pki

from .procs import ENVOY, PY, ROOT, Procs, free_port, http, post_json, wait_port


@dataclass
class Stack:
    """Model servers on loopback (``upstreams``: their ports) behind one picker and one Envoy;
    every process lives in ``procs``. A port left 0 is chosen free at start; a restarted picker or Envoy keeps
    its ports, so the other finds it again."""

    procs: Procs
    upstreams: list[int]
    envoy_port: int = 0
    admin_port: int = 0
    grpc_port: int = 0
    health_port: int = 0
    metrics_port: int = 0
    debug_port: int = 0
    """The picker's debug API (``--enable-debug-api``, on loopback); 0 while it is off."""
    listen_host: str = "127.0.0.1"
    """The address Envoy's listener binds (``render.py --listen-address``): this machine only,
    unless a caller asks for more (``0.0.0.0``)."""
    envoy_concurrency: int = 2
    """Envoy's worker threads (``--concurrency``)."""
    root: pathlib.Path = ROOT
    """The source tree whose ``deploy/envoy/render.py`` renders Envoy's config (another tree's,
    to run its picker with its own Envoy config beside this one's)."""
    mtls: bool = True
    """The picker requires a client certificate (``--client-ca-path``) and Envoy's rendered
    config presents one: a throwaway CA and both certificates made at the picker's first start
    under ``pki_dir`` (:func:`picker.serving.tls.local_pki`). Not for a plaintext picker
    (``--secure-serving false``), nor where the picker's or the renderer's tree predates mTLS;
    False: TLS as GIE's EPP serves it, with no client certificate (a config given whole, such as
    GIE's, presents none)."""
    pki_dir: pathlib.Path | None = None
    """Where the certificates live (default ``run_dir/pki``): stacks whose pickers sit behind one
    Envoy share it."""
    pki: LocalPki | None = field(default=None, init=False)
    """The certificates, once made; ``None`` while the picker runs without mTLS."""
    debug_token: str = field(default="", init=False)
    """The debug API's bearer token (``--debug-token-file``), once the picker serves it."""

    @property
    def debug_headers(self) -> dict[str, str]:
        """The header the debug API requires (``Authorization: Bearer <token>``)."""
        return {"authorization": f"Bearer {self.debug_token}"}

    @property
    def client_cert_args(self) -> list[str]:
        """``render.py`` arguments that make Envoy present the client certificate the picker
        requires (none when it requires none)."""
        return ["--client-cert-dir", str(self.pki.gateway)] if self.pki is not None else []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def addresses(self) -> list[str]:
        """The model servers as the picker names them (``127.0.0.1:port``)."""
        return [f"127.0.0.1:{p}" for p in self.upstreams]

    def start_picker(
        self,
        *extra: str,
        endpoints: list[int] | None = None,
        debug: bool = True,
        env: dict[str, str] | None = None,
        entry: tuple[str, ...] = ("-m", "picker"),
    ) -> subprocess.Popen[bytes]:
        """The picker on this stack's ports, routing to the loopback ports ``endpoints`` (default:
        the stack's upstreams; ``[]``: no static list, discovery comes from ``extra``, e.g.
        ``--pool-name``), started as ``python *entry`` (a wrapper such as ``bench.looplag`` that
        runs the picker with these arguments). Returns once its metrics and ext_proc ports accept
        connections."""
        self.grpc_port = self.grpc_port or free_port()
        self.health_port = self.health_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        eps = [f"127.0.0.1:{p}" for p in (self.upstreams if endpoints is None else endpoints)]
        args = [PY, *entry, "--endpoints", ",".join(eps), "--host", "127.0.0.1"]
        args += ["--grpc-port", str(self.grpc_port), "--grpc-health-port", str(self.health_port)]
        args += ["--metrics-port", str(self.metrics_port)]
        # the tree whose picker runs: PYTHONPATH's (with PYTHONSAFEPATH), else this checkout (the cwd)
        picker_tree = pathlib.Path((env or {}).get("PYTHONPATH") or ROOT)
        if debug:
            self.debug_port = self.debug_port or free_port()
            args += ["--enable-debug-api", "--debug-port", str(self.debug_port)]
            if supports(picker_tree / "picker" / "__main__.py", "--debug-token-file"):
                args += ["--debug-token-file", str(self._token_file())]
        self.pki = None
        if (
            self.mtls
            and not _plaintext(extra)
            and supports(picker_tree / "picker" / "__main__.py", "--client-ca-path")
            and supports(self.root / "deploy" / "envoy" / "render.py", "--client-cert-dir")
        ):
            self.pki = self._local_pki()
            args += ["--cert-path", str(self.pki.picker), "--client-ca-path", str(self.pki.ca)]
        proc = self.procs.start("picker", [*args, *extra], env)
        for port in (self.metrics_port, self.grpc_port):
            wait_port(port, procs=self.procs, proc=proc)
        return proc

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a direct gRPC channel to the picker's ext_proc port, as the gateway
        connects: the gateway's certificate and the CA under mTLS, else trusting the picker's
        (self-signed) certificate as served."""
        if self.pki is None:
            pem = ssl.get_server_certificate(("127.0.0.1", self.grpc_port)).encode()
            return grpc.ssl_channel_credentials(root_certificates=pem)
        return grpc.ssl_channel_credentials(
            root_certificates=self.pki.ca.read_bytes(),
            private_key=(self.pki.gateway / KEY).read_bytes(),
            certificate_chain=(self.pki.gateway / CERT).read_bytes(),
        )

    def _local_pki(self) -> LocalPki:
        """The stack's certificates, made once (a restarted picker keeps them: Envoy trusts them)."""
        root = self.pki_dir or self.procs.run_dir / "pki"
        if (root / "gateway" / CERT).exists():
            return LocalPki(root / "picker", root / "gateway")
        return local_pki(root)

    def _token_file(self) -> pathlib.Path:
        path = self.procs.run_dir / "debug-token"
        if not path.exists():
            path.write_text(secrets.token_urlsafe(24))
            path.chmod(0o600)
        self.debug_token = path.read_text().strip()
        return path

    def start_upstreams(self, *extra: str) -> subprocess.Popen[bytes]:
        """``kvlaunch.upstream`` (fake model servers that say which port served) on ``upstreams``."""
        ports = ",".join(map(str, self.upstreams))
        proc = self.procs.start("upstreams", [PY, "-m", "kvlaunch.upstream", "--ports", ports, *extra])
        for p in self.upstreams:
            wait_port(p, procs=self.procs, proc=proc)
        return proc

    def render_envoy(self, *render_args: str) -> str:
        """``deploy/envoy/render.py``'s config for this stack's ports, plus ``render_args``."""
        self.envoy_port = self.envoy_port or free_port()
        self.admin_port = self.admin_port or free_port()
        cmd = [PY, str(self.root / "deploy/envoy/render.py"), "--listen-port", str(self.envoy_port)]
        if self.listen_host != "0.0.0.0":  # a tree's renderer from before the flag binds 0.0.0.0
            cmd += ["--listen-address", self.listen_host]
        cmd += ["--admin-port", str(self.admin_port), "--picker", f"127.0.0.1:{self.grpc_port}", "-o", "-"]
        cmd += self.client_cert_args
        # its own session: a Ctrl-C is make run's to handle, not a traceback of the renderer's
        done = subprocess.run(
            [*cmd, *render_args], capture_output=True, cwd=self.root, start_new_session=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"rendering the Envoy config failed:\n{done.stderr.decode(errors='replace')}")
        return done.stdout.decode()

    def start_envoy(self, *render_args: str, config: str | None = None) -> subprocess.Popen[bytes]:
        """Envoy with ``config``, or with the rendered config (``render_args``); returns once its
        listener accepts connections. A given ``config`` must listen on ``envoy_port``."""
        text = self.render_envoy(*render_args) if config is None else config
        assert self.envoy_port, "a given Envoy config needs envoy_port set to the port it listens on"
        path = self.procs.run_dir / "envoy.yaml"
        path.write_text(text)
        cmd = [ENVOY, "-c", str(path), "-l", "warning", "--concurrency", str(self.envoy_concurrency)]
        cmd += ["--disable-hot-restart"]
        cmd += ["--file-flush-interval-msec", "250"]  # an access log (render.py) is read right after
        proc = self.procs.start("envoy", cmd)
        wait_port(self.envoy_port, procs=self.procs, proc=proc)
        return proc

    def endpoints(self) -> dict[str, Any]:
        """The picker's ``/debug/endpoints`` (needs ``debug=True``)."""
        _, body, _ = http(
            "GET", f"http://127.0.0.1:{self.debug_port}/debug/endpoints", headers=self.debug_headers
        )
        return dict(json.loads(body))

    def wait_in_flight_zero(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        eps = self.endpoints()
        while time.monotonic() < deadline:
            eps = self.endpoints()
            if all(e["in_flight_requests"] == 0 and e["in_flight_tokens"] == 0 for e in eps.values()):
                return eps
            time.sleep(0.1)
        raise AssertionError(f"in-flight did not return to zero: {eps}")

    def wait_routable(
        self, doc: Any | None = None, path: str = "/v1/completions", timeout: float = 30.0
    ) -> None:
        """Until ``doc`` posted through Envoy gets a 200 (the picker has scraped its endpoints)."""
        doc = doc if doc is not None else {"model": "m", "prompt": "warmup", "max_tokens": 1}
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            self.procs.check()
            with contextlib.suppress(OSError):
                status, last = post_json(self.url + path, doc)
                if status == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(
            f"stack never became routable: {last}\n{self.procs.log('picker')[-3000:]}\n"
            f"{self.procs.log('envoy')[-3000:]}"
        )


def supports(source: pathlib.Path, flag: str) -> bool:
    """Whether ``source`` (a picker's ``__main__``, or a ``render.py``) defines ``flag``: a tree
    from before it gets the arguments it knows."""
    return source.exists() and f'"{flag}"' in source.read_text()


def _plaintext(extra: tuple[str, ...]) -> bool:
    """Whether picker arguments ``extra`` turn TLS off (``--secure-serving false``)."""
    off = ("false", "0", "no", "off")
    pairs = zip(extra, (*extra[1:], ""), strict=False)
    return any(
        (a == "--secure-serving" and v.lower() in off)
        or (a.startswith("--secure-serving=") and a.split("=", 1)[1].lower() in off)
        for a, v in pairs
    )


@contextlib.contextmanager
def stack(
    tmp: pathlib.Path, n: int = 2, picker_args: tuple[str, ...] = (), envoy_args: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """``n`` fake upstreams, the picker (debug API on) and Envoy, routable and idle; all stopped after."""
    procs = Procs(tmp)
    st = Stack(procs, [free_port() for _ in range(n)])
    try:
        st.start_upstreams()
        st.start_picker(*picker_args)
        st.start_envoy(*envoy_args)
        st.wait_routable()
        st.wait_in_flight_zero()
        yield st
    finally:
        procs.stop()
