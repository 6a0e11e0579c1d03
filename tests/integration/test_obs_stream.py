"""GET /jobs/{id}/stream: what a reconnecting client is told once its job has ended."""

from __future__ import annotations

from tests.conftest import api_client
from tests.integration.test_stream import events, submit_toy


async def test_a_reconnect_after_the_final_event_is_told_to_stop(settings, make_worker):
    """The stream closes after the final event, and a browser's EventSource (which the docs say to
    use) then reconnects by itself with Last-Event-ID, 2 s later: it got an empty stream, closed
    again, and so on for ever, a request and a database read every 2 s for a job long finished.
    204 is what tells an EventSource to stop."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        await make_worker().run()
        history = (await http.get(f"/jobs/{job_id}/events")).json()
        final = history[-1]["id"]
        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            [last] = [e async for e in events(response)]
        assert last["id"] == final and last["data"]["state"] == "succeeded"

        again = await http.get(f"/jobs/{job_id}/stream", headers={"Last-Event-ID": str(final)})
        assert again.status_code == 204 and again.content == b"", again.text

        missed = {"Last-Event-ID": str(history[-2]["id"])}  # one it had not seen: it gets it
        async with http.stream("GET", f"/jobs/{job_id}/stream", headers=missed) as response:
            assert response.status_code == 200
            assert [e["id"] async for e in events(response)] == [final]
