"""Gateway access: tokens compared in constant time and never echoed, the Origin allow-list, per-address limits
whose books forget idle addresses."""
import json

import pytest

from services.common.config import GatewayAuthConfig
from services.gateway.access import Access, load_tokens, load_viewer_tokens

pytestmark = pytest.mark.cpu
TOKEN = "t0ken-0123456789abcdef"


def _auth(**kwargs) -> Access:
    return Access(GatewayAuthConfig(enabled=True, tokens_env="VITASCOPE_TOKENS", **kwargs), [TOKEN, "x" * 20])


def test_auth_off_lets_everything_in():
    assert Access(GatewayAuthConfig()).check_token({}, {}) is None


@pytest.mark.parametrize("headers, query", [
    ({"Authorization": f"Bearer {TOKEN}"}, {}),
    ({"Authorization": f"bearer {TOKEN}"}, {}),
    ({}, {"token": TOKEN}),
])
def test_a_configured_token_is_accepted_by_header_or_query(headers, query):
    assert _auth().check_token(headers, query) is None


@pytest.mark.parametrize("headers, query, says", [
    ({}, {}, "a token is required"),
    ({"Authorization": "Basic abc"}, {}, "must be 'Bearer <token>'"),
    ({"Authorization": "Bearer wrong-token-0000000000"}, {}, "not valid"),
    ({}, {"token": TOKEN[:-1]}, "not valid"),
    ({"Authorization": "Bearer wrong-token-0000000000"}, {"token": TOKEN}, "not valid"),  # the header decides
])
def test_a_missing_or_wrong_token_is_a_named_401_that_never_echoes_it(headers, query, says):
    refusal = _auth().check_token(headers, query)
    assert (refusal.status, refusal.code) == (401, "unauthorized") and says in refusal.message
    assert TOKEN not in refusal.message and "wrong-token" not in refusal.message


def test_tokens_come_from_a_file_and_a_variable(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# operators\n{TOKEN}\n\n{'y' * 16}  # the CDN\n")
    config = GatewayAuthConfig(enabled=True, tokens_file=str(path), tokens_env="T")
    assert load_tokens(config, {"T": f"{'z' * 16}, "}) == (TOKEN, "y" * 16, "z" * 16)
    with pytest.raises(ValueError, match="names T, which is not set"):
        load_tokens(config, {})
    with pytest.raises(ValueError, match="shorter than 16 characters"):
        load_tokens(GatewayAuthConfig(enabled=True, tokens_env="T"), {"T": "short"})
    with pytest.raises(ValueError, match="needs gateway.auth.tokens_file or gateway.auth.tokens_env"):
        GatewayAuthConfig(enabled=True)


def test_viewer_tokens_watch_but_cannot_start_and_director_tokens_do_both(tmp_path):
    viewer = "v13wer-0123456789abcdef"
    access = Access(GatewayAuthConfig(enabled=True, tokens_env="T"), [TOKEN], viewer_tokens=[viewer])
    assert access.check_token({}, {"token": TOKEN}) is None
    assert access.check_token({}, {"token": TOKEN}, watch=True) is None
    assert access.check_token({"Authorization": f"Bearer {viewer}"}, {}, watch=True) is None
    refusal = access.check_token({}, {"token": viewer})
    assert (refusal.status, refusal.code) == (403, "not_director") and viewer not in refusal.message
    assert access.check_token({}, {"token": "w" * 20}, watch=True).status == 401
    assert access.check_token({}, {}, watch=True).status == 401
    with pytest.raises(ValueError, match="both a director and a viewer token"):
        Access(GatewayAuthConfig(enabled=True, tokens_env="T"), [TOKEN], viewer_tokens=[TOKEN])
    path = tmp_path / "viewers"
    path.write_text(f"{viewer}  # the audience\n")
    config = GatewayAuthConfig(enabled=True, tokens_env="T", viewer_tokens_file=str(path), viewer_tokens_env="V")
    assert load_viewer_tokens(config, {"V": "u" * 16}) == (viewer, "u" * 16)
    assert load_viewer_tokens(GatewayAuthConfig(), {}) == ()
    with pytest.raises(ValueError, match="viewer_tokens_env names V"):
        load_viewer_tokens(config, {})


@pytest.mark.parametrize("origin, host, ok", [
    (None, "gw:8000", True),                        # not a browser
    ("http://gw:8000", "gw:8000", True),            # the page's own origin
    ("http://localhost:5173", "gw:8000", True),     # loopback
    ("http://127.0.0.1:9", "gw:8000", True),
    ("https://shop.example", "gw:8000", True),      # allowed
    ("https://evil.example", "gw:8000", False),
    ("http://gw:8001", "gw:8000", False),
])
def test_browser_origins_are_checked_against_the_allow_list(origin, host, ok):
    refusal = Access(GatewayAuthConfig(allowed_origins=("https://shop.example/",))).check_origin(origin, host)
    assert (refusal is None) == ok
    if not ok:
        assert refusal.status == 403 and refusal.code == "origin_not_allowed" and origin in refusal.message


def test_a_bad_allowed_origin_is_refused_by_name():
    with pytest.raises(ValueError, match="'shop.example'"):
        GatewayAuthConfig(allowed_origins=("shop.example",))


def test_open_connections_are_limited_per_address_and_forgotten_when_closed():
    access = Access(GatewayAuthConfig(max_connections_per_address=2))
    assert access.open_connection("10.0.0.1") is None and access.open_connection("10.0.0.1") is None
    refusal = access.open_connection("10.0.0.1")
    assert (refusal.status, refusal.code) == (429, "too_many_connections")
    assert access.open_connection("10.0.0.2") is None  # another address is not affected
    for address in ("10.0.0.1", "10.0.0.1", "10.0.0.2"):
        access.close_connection(address)
    assert access.tracked_addresses() == 0


def test_session_starts_are_rate_limited_per_address_over_a_sliding_minute():
    now = [0.0]
    access = Access(GatewayAuthConfig(starts_per_minute_per_address=3), clock=lambda: now[0])
    for _ in range(3):
        assert access.allow_start("a") is None
    assert access.allow_start("a").code == "rate_limited"
    assert access.allow_start("b") is None
    now[0] = 61.0
    assert access.allow_start("a") is None
    now[0] = 200.0
    access.allow_start("c")
    assert access.tracked_addresses() == 1  # a and b were forgotten: the books do not grow with traffic


# ---------------------------------------------------------------- wired into a running gateway

async def _get_status(url: str, headers=None) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=headers or {}) as reply:
            text = await reply.text()
            return reply.status, json.loads(text) if reply.content_type == "application/json" else {}


async def test_with_auth_on_a_websocket_without_a_token_gets_a_named_401_and_one_with_it_streams():
    from services.common.config import GatewayAuthConfig
    from tests.gateway.fakes import FakePipeline, running_gateway, run_good_session, small_config, ws_url

    config = small_config(auth=GatewayAuthConfig(enabled=True, tokens_env="T", protect_metrics=True))
    access = Access(config.auth, [TOKEN])
    async with running_gateway(config, FakePipeline(), access=access) as server:
        url = ws_url(server).replace("ws://", "http://")
        status, body = await _get_status(url)
        assert status == 401 and body["code"] == "unauthorized" and body["fault"] == "client"
        status, body = await _get_status(url + "?token=wrong-0000000000000000")
        assert status == 401 and "not valid" in body["message"]
        status, _ = await _get_status(str(server.make_url("/metrics")))
        assert status == 401
        status, _ = await _get_status(str(server.make_url("/metrics")), {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        status, _ = await _get_status(str(server.make_url("/healthz")))  # probes need no token
        assert status == 200
        transcript = await run_good_session(server, token=TOKEN)
        assert transcript.of_type("session.done")


async def test_a_cross_site_websocket_is_refused_and_a_flood_of_starts_is_rate_limited():
    import aiohttp

    from services.common.config import GatewayAuthConfig
    from tests.gateway.fakes import FakePipeline, running_gateway, small_config, ws_url

    config = small_config(auth=GatewayAuthConfig(starts_per_minute_per_address=2, max_connections_per_address=3))
    async with running_gateway(config, FakePipeline()) as server:
        status, body = await _get_status(ws_url(server).replace("ws://", "http://"),
                                         {"Origin": "https://evil.example"})
        assert status == 403 and body["code"] == "origin_not_allowed"
        codes = []
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.ws_connect(ws_url(server)) as ws:
                    await ws.send_json({"type": "session.start", "prompt": "hello"})
                    reply = await ws.receive_json(timeout=10)
                    codes.append(reply.get("code") if reply["type"] == "error" else reply["type"])
            held = [await http.ws_connect(ws_url(server)) for _ in range(3)]
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await http.ws_connect(ws_url(server))
            assert err.value.status == 429
            for ws in held:
                await ws.close()
    assert "rate_limited" not in codes[:2] and codes[2] == "rate_limited"
