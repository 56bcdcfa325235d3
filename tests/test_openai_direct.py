"""The OpenAI adapter's own HTTP/1.1 client sends what the `openai` SDK sends, and fails alike.

Each case runs the same request through both routes (`transport="direct"`, the default, and
`transport="sdk"`) against the loopback mock, which records every request's headers, and
compares: the headers (auth, organisation, project, the user agent and the SDK's platform
headers, custom headers), the retries (429/5xx, Retry-After, connection errors) with their
`X-Stainless-Retry-Count`, and the error each failure becomes. The last tests pin what an idle
worker does not import.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ag_ui.core import UserMessage

from copilot_runtime import ConfigurationError, OpenAIAdapter, UpstreamError
from copilot_runtime._exceptions import UpstreamConnectionError, UpstreamTimeoutError
from copilot_runtime.adapters import ChatRequest, TextDelta
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import RawServer, free_port
from tests.test_hardening import FaultyLLM

TIMEOUT_S = 30
ROUTES = ("direct", "sdk")


@pytest.fixture
async def mock() -> AsyncIterator[MockOpenAIServer]:
    async with MockOpenAIServer(chunks=4) as server:
        yield server


async def answer(adapter: OpenAIAdapter, text: str = "hello") -> str:
    try:
        async with asyncio.timeout(TIMEOUT_S):
            deltas = [d async for batch in adapter.stream(ChatRequest(
                messages=[UserMessage(id="u", content=text)])) for d in batch]
    finally:
        await adapter.aclose()
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))


async def failure(adapter: OpenAIAdapter, text: str = "hello") -> UpstreamError:
    with pytest.raises(UpstreamError) as info:
        await answer(adapter, text)
    return info.value


def both(**options: Any) -> list[OpenAIAdapter]:
    return [OpenAIAdapter(transport=route, **options) for route in ROUTES]  # type: ignore[arg-type]


async def test_default_route_is_direct_and_sdk_is_an_option(mock: MockOpenAIServer) -> None:
    direct, sdk = both(base_url=mock.base_url, api_key="k")
    assert (direct.transport, sdk.transport) == ("direct", "sdk")
    assert OpenAIAdapter(base_url=mock.base_url).transport == "direct"
    with pytest.raises(ConfigurationError, match="transport"):
        OpenAIAdapter(base_url=mock.base_url, transport="h2")  # type: ignore[arg-type]


async def test_a_ready_client_or_a_proxy_goes_through_the_sdk(
        mock: MockOpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    client = openai.AsyncOpenAI(api_key="k", base_url=mock.base_url, max_retries=0)
    adapter = OpenAIAdapter(client=client)
    assert adapter.transport == "sdk"
    assert await answer(adapter) == "echo: hello"
    await client.close()  # the application's: the adapter leaves it open
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert OpenAIAdapter(base_url=mock.base_url).transport == "sdk"
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("OPENAI_CUSTOM_HEADERS", "X-A: 1")
    assert OpenAIAdapter(base_url=mock.base_url).transport == "sdk"


@pytest.mark.parametrize("settings", [
    {"api_key": "sk-test"},
    {"api_key": "sk-test", "organization": "org-1", "project": "proj-1",
     "default_headers": {"X-Custom": "yes", "User-Agent": "my-app/1.0"}},
])
async def test_same_headers_as_the_sdk(mock: MockOpenAIServer, settings: dict[str, Any]) -> None:
    for adapter in both(base_url=mock.base_url, timeout=30.0, max_retries=0, **settings):
        assert await answer(adapter) == "echo: hello"
    direct, sdk = mock.headers
    assert direct == sdk
    assert direct["authorization"] == "Bearer sk-test"
    if "organization" in settings:
        assert (direct["openai-organization"], direct["openai-project"]) == ("org-1", "proj-1")
        assert (direct["x-custom"], direct["user-agent"]) == ("yes", "my-app/1.0")
    else:
        assert direct["user-agent"].startswith("AsyncOpenAI/Python ")
    assert direct["x-stainless-read-timeout"] == "30.0"
    assert mock.requests[0] == mock.requests[1]


async def test_key_base_url_organisation_and_project_from_the_environment(
        mock: MockOpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_ORG_ID", "org-env")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-env")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("OPENAI_BASE_URL", mock.base_url)
    for adapter in both(max_retries=0):
        await answer(adapter)
    direct, sdk = mock.headers
    assert direct == sdk
    assert direct["openai-organization"] == "org-env"
    assert direct["authorization"] == "Bearer sk-env"


@pytest.mark.parametrize("route", ROUTES)
async def test_retries_429_and_5xx_honouring_retry_after(mock: MockOpenAIServer,
                                                         route: str) -> None:
    mock.statuses = [503, 429]
    mock.retry_after = "0.05"
    adapter = OpenAIAdapter(base_url=mock.base_url, max_retries=2,
                            transport=route)  # type: ignore[arg-type]
    assert await answer(adapter) == "echo: hello"
    assert [h["x-stainless-retry-count"] for h in mock.headers] == ["0", "1", "2"]


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_retries_run_out_with_the_same_error(mock: MockOpenAIServer, status: int) -> None:
    errors = []
    for adapter in both(base_url=mock.base_url, max_retries=1):
        mock.statuses = [status, status]
        mock.retry_after = "0"
        errors.append(await failure(adapter))
    assert len(mock.headers) == 4  # two attempts each
    direct, sdk = errors
    assert (type(direct), direct.status, direct.message) == (type(sdk), sdk.status, sdk.message)
    assert direct.message == f"OpenAI request failed with HTTP {status}: mock error {status}"


@pytest.mark.parametrize("status", [400, 401, 404])
async def test_client_errors_are_not_retried(mock: MockOpenAIServer, status: int) -> None:
    errors = [await failure(adapter, f"error:{status}")
              for adapter in both(base_url=mock.base_url, max_retries=2)]
    assert len(mock.headers) == 2  # one attempt each
    assert errors[0].message == errors[1].message
    assert errors[0].status == errors[1].status == status


class HangUpOnce(RawServer):
    """A server that closes its first connection without answering, then proxies to `target`."""

    def __init__(self, target: MockOpenAIServer) -> None:
        super().__init__()
        self.target = target
        self.connections = 0

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.connections == 1:
            await reader.readuntil(b"\r\n\r\n")
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(
            self.target.host, self.target.port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


@pytest.mark.parametrize("route", ROUTES)
async def test_a_connection_error_is_retried(mock: MockOpenAIServer, route: str) -> None:
    async with HangUpOnce(mock) as flaky:
        adapter = OpenAIAdapter(base_url=flaky.base_url, max_retries=1,
                                transport=route)  # type: ignore[arg-type]
        assert await answer(adapter) == "echo: hello"
        assert flaky.connections == 2
    assert [h["x-stainless-retry-count"] for h in mock.headers] == ["1"]


async def test_refused_connection_is_the_same_error() -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    errors = [await failure(adapter) for adapter in both(base_url=dead, max_retries=1)]
    assert [type(e) for e in errors] == [UpstreamConnectionError] * 2
    assert errors[0].message == errors[1].message


@pytest.mark.parametrize(("mode", "kind", "message"), [
    ("close", UpstreamConnectionError, "closed the connection without answering"),
    ("cut", UpstreamConnectionError, "broke off before the answer was complete"),
    ("stall_first", UpstreamTimeoutError, "sent nothing for 0.5 s"),
    ("stall_mid", UpstreamTimeoutError, "sent nothing for 0.5 s"),
])
async def test_faults_map_to_the_same_errors(mode: str, kind: type[UpstreamError],
                                             message: str) -> None:
    errors = []
    for route in ROUTES:
        async with FaultyLLM(mode) as upstream:
            errors.append(await failure(OpenAIAdapter(
                base_url=upstream.base_url, api_key="k", timeout=0.5, max_retries=1,
                transport=route)))  # type: ignore[arg-type]
            assert upstream.requests == (2 if mode in ("close", "stall_first") else 1)
    for error in errors:
        assert type(error) is kind
        assert message in error.message
    assert errors[0].message == errors[1].message


async def test_connections_are_kept_alive_and_a_stop_cancels_upstream(
        mock: MockOpenAIServer) -> None:
    adapter = OpenAIAdapter(base_url=mock.base_url, max_retries=0)
    route = adapter._direct
    assert route is not None
    try:
        for _ in range(3):
            async for _ in adapter.stream(ChatRequest(messages=[UserMessage(
                    id="u", content="hi")])):
                pass
        assert len(route.pool._idle) == 1  # one connection served all three
        stream = adapter.stream(ChatRequest(messages=[UserMessage(
            id="u", content="slow:200 a b c d")]))
        await anext(aiter(stream))
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(100):
            if mock.cancelled_streams:
                break
            await asyncio.sleep(0.02)
        assert mock.cancelled_streams == 1
        assert mock.active_streams == 0
    finally:
        await adapter.aclose()


# -- what an idle worker does not import ------------------------------------------------------

#: Imported only by the deployments that use them.
HEAVY = ("openai", "httpx2", "httpx", "aiohttp", "anthropic", "google.genai", "langgraph",
         "langchain_core", "ag_ui_langgraph", "graphql", "jsonschema", "jsonpatch", "mcp",
         "jwt", "opentelemetry", "redis", "psycopg", "websockets", "starlette.routing")


def test_an_openai_endpoint_imports_no_heavy_module() -> None:
    code = textwrap.dedent("""
        import sys
        import copilot_runtime
        from copilot_runtime import CopilotRuntime, OpenAIAdapter, action, create_app

        @action
        def weather(city: str) -> dict:
            return {"city": city}

        runtime = CopilotRuntime(service_adapter=OpenAIAdapter(
            base_url="http://127.0.0.1:9/v1", api_key="k"), actions=[weather])
        create_app(runtime, "/api/copilotkit")
        print(" ".join(sorted(sys.modules)))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    loaded = set(done.stdout.split())
    assert "copilot_runtime.adapters.openai" in loaded
    assert not [m for m in HEAVY if m in loaded], sorted(m for m in HEAVY if m in loaded)


def test_sdk_route_and_remote_agents_import_on_first_use() -> None:
    code = textwrap.dedent("""
        import sys
        from copilot_runtime import HttpAgent, OpenAIAdapter
        assert "aiohttp" in sys.modules and HttpAgent.__name__ == "HttpAgent"
        assert "openai" not in sys.modules
        OpenAIAdapter(base_url="http://127.0.0.1:9/v1", transport="sdk").client
        assert "openai" in sys.modules
    """)
    subprocess.run([sys.executable, "-c", code], timeout=60, check=True)


# -- TLS ---------------------------------------------------------------------------------------


def _self_signed(directory: Any) -> tuple[str, str]:
    """A certificate for localhost that is its own CA: (certificate file, key file)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


async def test_https_with_certificate_verification(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import ssl

    from aiohttp import web

    cert, key = _self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    mock = MockOpenAIServer(chunks=3)
    runner = web.AppRunner(mock.app(), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_context).start()
    try:
        # Not trusted yet: the certificate is refused, as the SDK would refuse it.
        error = await failure(OpenAIAdapter(base_url=f"https://localhost:{port}/v1",
                                            api_key="k", max_retries=0))
        assert type(error) is UpstreamConnectionError
        monkeypatch.setenv("SSL_CERT_FILE", cert)
        adapter = OpenAIAdapter(base_url=f"https://localhost:{port}/v1", api_key="k",
                                max_retries=0)
        assert adapter.transport == "direct"
        assert await answer(adapter, "over TLS") == "echo: over TLS"
        assert mock.headers[-1]["host"] == f"localhost:{port}"
    finally:
        await runner.cleanup()
