"""A small HTTP client for the parts of SGLang's API a capture uses.

Endpoints (sglang 0.5.23; older names in brackets): ``GET /server_info`` [``/get_server_info``],
``GET /model_info`` [``/get_model_info``], ``GET /v1/loads`` (running batch per DP rank),
``POST /start_profile`` and ``POST /stop_profile``. The API key is sent as ``Authorization: Bearer``
and never appears in a message, a log line or a repr.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from traceinspect.capture.errors import (
    AuthError,
    CaptureError,
    ConfigError,
    ProfileRejected,
    ServerUnreachable,
)

# SGLang's scheduler refuses a second profile with this text; the HTTP layer answers 500 and logs it.
ALREADY_RUNNING = "Profiling is already in progress"


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``; refuses URLs with credentials."""
    raw = url.strip()
    if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", raw):
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"server URL must be http or https, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise ConfigError("server URL has no host")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise ConfigError(f"server URL has an invalid port: {url!r}") from None
    if parts.netloc.endswith(":"):
        raise ConfigError(f"server URL has an empty port: {url!r}")
    if parts.username or parts.password:
        raise ConfigError("put the API key in --api-key (or TRACEINSPECT_API_KEY), not in the URL")
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


class SGLangClient:
    """Synchronous client for one server; raises :mod:`traceinspect.capture.errors` on failure."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None, admin_api_key: str | None = None) -> None:
        self.url = normalize_url(url)
        self._has_key = bool(api_key)
        self._has_admin_key = bool(admin_api_key)
        # SGLang's profiling endpoints take the admin key when the server has one, else the api key
        admin = admin_api_key or api_key
        self._admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                  transport=transport, follow_redirects=False, trust_env=False)

    def __repr__(self) -> str:
        return (f"SGLangClient({self.url!r}, api_key={'<set>' if self._has_key else None}, "
                f"admin_api_key={'<set>' if self._has_admin_key else None})")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------

    def request(self, method: str, path: str, *, json: Any = None, timeout: float | None = None,
                auth_hint: str = "", admin: bool = False) -> httpx.Response:
        """Send one request; connection problems and 401/403 become capture errors.

        ``admin`` marks SGLang's ADMIN_OPTIONAL endpoints (profiling), which take the admin key.
        """
        kw: dict[str, Any] = {}
        if admin:
            kw["headers"] = self._admin_headers
        if json is not None:
            kw["json"] = json
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            r = self._http.request(method, path, **kw)
        except httpx.ConnectError as e:
            reason = "connection refused" if "refused" in str(e).lower() else _short(e)
            raise ServerUnreachable(
                f"cannot reach the server at {self.url} ({reason}); is it running, and is the URL right?"
            ) from None
        except httpx.TimeoutException:
            raise ServerUnreachable(f"{method} {path} on {self.url} timed out") from None
        except httpx.HTTPError as e:
            raise ServerUnreachable(f"{method} {path} on {self.url} failed: {_short(e)}") from None
        if r.status_code == 401:
            if admin and self._has_admin_key:
                msg = f"the server rejected the admin API key for {path} (HTTP 401)"
            elif admin and self._has_key:
                msg = (f"the server rejected the API key for {path} (HTTP 401); a server started with "
                       "--admin-api-key takes only that key here: pass --admin-api-key")
            elif self._has_key:
                msg = f"the server rejected the API key for {path} (HTTP 401)"
            else:
                msg = (f"the server requires an API key for {path} (HTTP 401): pass --api-key "
                       "or set TRACEINSPECT_API_KEY")
            raise AuthError(msg + (f"; {auth_hint}" if auth_hint else ""))
        if r.status_code == 403:
            raise AuthError(
                f"the server forbids {path} (HTTP 403): it needs the admin API key "
                "(the server's --admin-api-key; pass it with --admin-api-key)" + (f"; {auth_hint}" if auth_hint else ""))
        return r

    def _get_json(self, paths: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
        last: httpx.Response | None = None
        for path in paths:
            r = self.request("GET", path)
            if r.status_code == 404:
                last = r
                continue
            if r.status_code != 200:
                raise CaptureError(f"GET {path} on {self.url} answered HTTP {r.status_code}: {_body(r)}")
            try:
                data = r.json()
            except ValueError:
                raise ServerUnreachable(f"GET {path} on {self.url} did not return JSON; is this an SGLang server?"
                                        ) from None
            if not isinstance(data, dict):
                raise CaptureError(f"GET {path} on {self.url} returned {type(data).__name__}, expected an object")
            return path, data
        assert last is not None
        raise ServerUnreachable(
            f"{self.url} has none of {', '.join(paths)} (HTTP 404); is this an SGLang server?")

    # -- endpoints ------------------------------------------------------------------------------

    def server_info(self) -> tuple[str, dict[str, Any]]:
        """``(endpoint used, flat server_info)``, falling back to the pre-0.5 ``/get_server_info``."""
        return self._get_json(("/server_info", "/get_server_info"))

    def model_info(self) -> tuple[str, dict[str, Any]]:
        """``(endpoint used, model_info)``, falling back to ``/get_model_info``."""
        return self._get_json(("/model_info", "/get_model_info"))

    def running_requests(self) -> int | None:
        """Requests in the running batch, summed over DP ranks, or None where the server doesn't say.

        Reads ``GET /v1/loads?include=core`` (``loads[i].num_running_reqs``), else the Prometheus
        gauge ``sglang:num_running_reqs`` on ``/metrics`` (servers started with ``--enable-metrics``).
        """
        r = self.request("GET", "/v1/loads?include=core", timeout=10.0)
        if r.status_code == 200:
            try:
                loads = r.json().get("loads")
                if isinstance(loads, list) and loads:
                    return int(sum(int(x.get("num_running_reqs", 0)) for x in loads if isinstance(x, dict)))
            except (ValueError, AttributeError, TypeError):
                pass
        r = self.request("GET", "/metrics", timeout=10.0)
        if r.status_code == 200 and "num_running_reqs" in r.text:
            total, seen = 0.0, False
            for line in r.text.splitlines():
                if line.startswith("sglang:num_running_reqs") or line.startswith("sglang_num_running_reqs"):
                    try:
                        total += float(line.rsplit(None, 1)[-1])
                        seen = True
                    except ValueError:
                        pass
            if seen:
                return int(total)
        return None

    def load_state(self) -> dict[str, Any] | None:
        """The scheduler's load summed over DP ranks: ``running``, ``waiting``, ``used_tokens``,
        ``max_total_num_tokens``, ``max_running_requests``, ``token_usage`` (the highest rank's),
        ``gen_throughput`` (generated tokens/s, as the scheduler last logged it) and ``source``; None where the
        server reports none of it.

        Reads ``GET /v1/loads?include=core`` (SGLang's ``loads``: one snapshot per DP rank), else the
        ``sglang:num_running_reqs``, ``sglang:num_queue_reqs`` and ``sglang:token_usage`` gauges on ``/metrics``.
        """
        r = self.request("GET", "/v1/loads?include=core", timeout=10.0)
        if r.status_code == 200:
            try:
                loads = [x for x in (r.json().get("loads") or []) if isinstance(x, dict)]
            except (ValueError, AttributeError, TypeError):
                loads = []
            if loads:
                def total(key: str) -> int | None:
                    vals = [x.get(key) for x in loads if isinstance(x.get(key), (int, float))]
                    return int(sum(vals)) if vals else None

                usage = [float(x["token_usage"]) for x in loads if isinstance(x.get("token_usage"), (int, float))]
                gen = [float(x["gen_throughput"]) for x in loads if isinstance(x.get("gen_throughput"), (int, float))]
                return {"running": total("num_running_reqs") or 0, "waiting": total("num_waiting_reqs") or 0,
                        "used_tokens": total("num_used_tokens"), "max_total_num_tokens": total("max_total_num_tokens"),
                        "max_running_requests": total("max_running_requests"),
                        "token_usage": max(usage) if usage else None,
                        "gen_throughput": sum(gen) if gen else None, "source": "/v1/loads"}
        r = self.request("GET", "/metrics", timeout=10.0)
        if r.status_code != 200 or "num_running_reqs" not in r.text:
            return None
        sums: dict[str, float] = {}
        peak: dict[str, float] = {}
        for line in r.text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0].replace("sglang_", "sglang:", 1)
            if name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                        "sglang:gen_throughput"):
                try:
                    v = float(line.rsplit(None, 1)[-1])
                except ValueError:
                    continue
                sums[name] = sums.get(name, 0.0) + v
                peak[name] = max(peak.get(name, v), v)
        return {"running": int(sums.get("sglang:num_running_reqs", 0)),
                "waiting": int(sums.get("sglang:num_queue_reqs", 0)), "used_tokens": None,
                "max_total_num_tokens": None, "max_running_requests": None,
                "token_usage": peak.get("sglang:token_usage"), "gen_throughput": sums.get("sglang:gen_throughput"),
                "source": "/metrics"}

    def start_profile(self, body: dict[str, Any]) -> str:
        """POST ``/start_profile``; returns the reply text (``Start profiling.``) once the profiler is armed."""
        r = self.request("POST", "/start_profile", json=body, timeout=120.0, admin=True)
        if r.status_code == 200:
            return r.text.strip()
        text = _body(r)
        if ALREADY_RUNNING.lower() in text.lower() or r.status_code == 500:
            raise ProfileRejected(
                f"the server refused to start profiling (HTTP {r.status_code}: {text}). SGLang answers this "
                f"way when a profile is already in progress (its log says '{ALREADY_RUNNING}. Call "
                "/stop_profile first.') or when the torch profiler failed to start: wait for the running "
                f"profile to finish or POST {self.url}/stop_profile, then retry")
        if r.status_code in (400, 422):
            raise ProfileRejected(f"the server rejected the profile request (HTTP {r.status_code}): {text}")
        if r.status_code == 404:
            raise ProfileRejected(f"{self.url} has no /start_profile (HTTP 404); is this an SGLang server?")
        raise ProfileRejected(f"/start_profile answered HTTP {r.status_code}: {text}")

    def stop_profile(self, timeout: float = 120.0) -> tuple[bool, str]:
        """POST ``/stop_profile``; ``(ok, reply)``. A 500 usually means no profile was running."""
        r = self.request("POST", "/stop_profile", timeout=timeout, admin=True)
        return r.status_code == 200, _body(r)


def _short(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s[:200] or type(e).__name__


def _body(r: httpx.Response) -> str:
    try:
        data = r.json()
    except ValueError:
        return " ".join(r.text.split())[:300] or "(empty body)"
    if isinstance(data, dict):
        for key in ("message", "error", "detail"):
            if key in data:
                v = data[key]
                return " ".join(str(v).split())[:300]
    return " ".join(str(data).split())[:300]
