"""worker_svc/event_publisher.py against a real redis-server: events in order, none lost to
a broken connection or to a Redis out of reach for a while, a refused command raised."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from proto.messages import TokenEvent, events_decoder
from worker_svc.event_publisher import EventPublisher


def received(subscription, count: int) -> list[TokenEvent]:
    """`count` events off the subscription, in the order they came."""
    events: list[TokenEvent] = []
    deadline = time.monotonic() + 10
    while len(events) < count:
        assert time.monotonic() < deadline, f"{len(events)} of {count} events came"
        message = subscription.get_message(timeout=1)
        if message and message["type"] == "message":
            events.extend(events_decoder.decode(message["data"]))
    return events


def batch(channels: list[str], index: int) -> dict[str, list[TokenEvent]]:
    return {channel: [TokenEvent(channel, index, [index])] for channel in channels}


@pytest.fixture
def channels(redis_url):
    """Two fresh channels, a subscription to both and a plain client."""
    client = redis.Redis.from_url(redis_url)
    names = [f"events-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
    subscription = client.pubsub()
    subscription.subscribe(*names)
    while len([m for m in iter(lambda: subscription.get_message(timeout=1), None)
               if m["type"] == "subscribe"]) < 2:
        pass
    yield names, subscription, client
    subscription.close()
    client.close()


def test_events_go_out_in_publish_order_on_every_channel(redis_url, channels):
    names, subscription, _ = channels
    publisher = EventPublisher(redis.Redis.from_url(redis_url))
    for index in range(50):
        publisher.publish(batch(names, index))
    publisher.flush()  # every reply read: nothing was refused
    events = received(subscription, 100)
    for name in names:
        assert [e.index for e in events if e.request_id == name] == list(range(50))
    publisher.close()


def kill(client, name: str) -> None:
    """Close the connection named `name` from Redis's side."""
    killed = [c for c in client.client_list() if c.get("name") == name]
    assert len(killed) == 1
    client.client_kill(killed[0]["addr"])


def test_a_broken_connection_loses_no_events(redis_url, channels):
    names, subscription, client = channels
    publisher = EventPublisher(redis.Redis.from_url(redis_url, client_name="events-broken"))
    publisher.publish(batch(names, 0))
    kill(client, "events-broken")
    for index in (1, 2):  # the first on a connection Redis closed: sent again on a new one
        publisher.publish(batch(names, index))
    events = received(subscription, 6)
    for name in names:  # a repeat is allowed (the gateway drops it by index), a gap is not
        indexes = [e.index for e in events if e.request_id == name]
        assert sorted(set(indexes)) == [0, 1, 2] and indexes == sorted(indexes)
    publisher.close()


@pytest.fixture
def user(channels):
    """An ACL user that may publish anywhere, for a publisher that can be locked out."""
    _, _, client = channels
    name = f"publisher-{uuid.uuid4().hex[:6]}"
    client.execute_command("ACL", "SETUSER", name, "on", ">secret", "allchannels", "+@all", "~*")
    yield name
    client.execute_command("ACL", "DELUSER", name)


def test_events_redis_could_not_take_go_out_first_once_it_is_back(redis_url, channels, user):
    """While the publisher cannot reach Redis (here: its connection closed and its user
    disabled, so every reconnection is refused) publishes raise and keep their events;
    the first publish that gets through sends them, in order, before its own."""
    names, subscription, client = channels
    publisher = EventPublisher(redis.Redis.from_url(
        redis_url, username=user, password="secret", client_name="events-locked-out",
        retry=Retry(NoBackoff(), 1)))
    publisher.publish(batch(names, 0))
    client.execute_command("ACL", "SETUSER", user, "off")
    kill(client, "events-locked-out")
    for index in (1, 2):
        with pytest.raises(redis.ConnectionError):
            publisher.publish(batch(names, index))
    with pytest.raises(redis.ConnectionError):
        publisher.flush()
    assert publisher.pending  # what an idle worker's retry_unsent sends once Redis is back
    client.execute_command("ACL", "SETUSER", user, "on")
    publisher.publish(batch(names, 3))
    assert not publisher.pending
    events = received(subscription, 8)
    for name in names:
        assert [e.index for e in events if e.request_id == name] == [0, 1, 2, 3]
    publisher.close()


def test_a_batch_that_finishes_a_request_is_out_when_publish_returns(redis_url, channels):
    """The scheduler acknowledges a finished request once the step's result is back: its
    last events must not wait in a closed connection for a publish that may never come."""
    names, subscription, client = channels
    publisher = EventPublisher(redis.Redis.from_url(redis_url, client_name="events-finishing"))
    publisher.publish(batch(names, 0))
    publisher.flush()
    kill(client, "events-finishing")
    publisher.publish({names[0]: [TokenEvent(names[0], 1, [1], finish_reason="length")]})
    last = received(subscription, 3)[-1]  # no flush, no publish after it
    assert (last.request_id, last.index, last.finish_reason) == (names[0], 1, "length")
    publisher.close()


def test_a_refused_publish_raises_once_the_rest_of_its_batch_is_out(redis_url, channels):
    names, subscription, client = channels
    user = f"limited-{uuid.uuid4().hex[:6]}"
    client.execute_command("ACL", "SETUSER", user, "on", ">secret", "resetchannels",
                           f"&{names[0]}", "+@all", "~*")
    try:
        publisher = EventPublisher(redis.Redis.from_url(redis_url, username=user, password="secret"))
        with pytest.raises(redis.ResponseError, match="permission"):
            publisher.publish(batch(names, 0))  # names[1] is not this user's to publish to
        publisher.publish(batch(names[:1], 1))  # the refused one is not sent again
        publisher.flush()
        assert [(e.request_id, e.index) for e in received(subscription, 2)] == [(names[0], 0), (names[0], 1)]
        assert subscription.get_message(timeout=0.2) is None
        publisher.close()
    finally:
        client.execute_command("ACL", "DELUSER", user)
