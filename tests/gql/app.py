"""The runtime `tests/test_graphql_real_client.py` serves: the built-in agent on the loopback
mock LLM with the server-side action `getWeather`, as the TypeScript anchor runtime has.

CORS reflects the client's origin and allows credentials, as a browser client configured with
`credentials: "include"` needs (the 1.10 runtime reflects any origin; this one only those listed).
"""

from __future__ import annotations

from copilot_runtime import CORSPolicy, create_app
from tests.realclient_app import mock_llm_runtime

runtime = mock_llm_runtime()
app = create_app(runtime, "/copilotkit", cors=CORSPolicy(
    origins=("http://localhost:3000",), allow_credentials=True))
