"""What the saved sessions take on disk, in the app (headless, with Pilot, on a real
store; the fake engine stands in for the model): the sessions list's Disk column, a
recall tier the disk budget dropped, and the budget's note as a notification."""

from __future__ import annotations

import asyncio
import threading

from store_helpers import cold_layers

from kvchat.settings import human_size

from .conftest import APP_SIZE, notifications, wait_for
from .test_sessions_search import cells, fake_app, open_sessions


def test_the_list_shows_what_each_session_takes_and_a_dropped_tier(store):
    ids = []
    for title in ("Older", "Newer"):
        sid = store.create_session(title, "fake", "window", {})
        store.save_turn(sid, [], 1, {}, [{}], cold_rows=cold_layers(1, 500, title))
        ids.append(sid)
    store.disk_budget = 1
    store.fit_disk_budget(keep=ids[1])  # the older one's tier goes
    sizes = {r.id: human_size(r.disk_bytes) for r in store.list_sessions()}

    async def body():
        async with fake_app(store).run_test(size=APP_SIZE) as pilot:
            screen = await open_sessions(pilot)
            newer, older = cells(screen)
            assert newer[5] == sizes[ids[1]]
            assert older[5] == f"{sizes[ids[0]]} tier dropped"

    asyncio.run(body())


def test_a_note_of_the_disk_budget_from_the_saving_worker_is_a_notification(store):
    line = "disk budget 2.0 GB: dropped the recall tiers of 2 older sessions (410.0 MB)"

    async def body():
        app = fake_app(store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await wait_for(pilot, lambda: app.activity is None, 10, "the (fake) model to load")
            saver = threading.Thread(target=app.controller.on_disk_note, args=(line,))
            saver.start()
            await wait_for(pilot, lambda: not saver.is_alive(), 10, "the note")
            assert "Disk budget 2.0 GB: dropped the recall tiers of 2 older sessions (410.0 MB)" in notifications(app)

    asyncio.run(body())
