"""The client's REST paths, checked against the paths the official client's typed APIs build for
the same objects (its generated code is the reference), and its error parsing."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from specdecode_operator import kube as k8s
from specdecode_operator.spec import GROUP, PLURAL, VERSION


class _Recorded(Exception):
    pass


class RecordingApiClient(client.ApiClient):
    """Builds requests like the real client, then records the URL instead of sending it."""

    def __init__(self):
        super().__init__(client.Configuration(host="https://api.test"))
        self.urls: list[tuple[str, str]] = []

    def call_api(self, method, url, *args, **kwargs):
        self.urls.append((method, url.removeprefix("https://api.test").split("?")[0]))
        raise _Recorded()


def official_path(call) -> str:
    api = RecordingApiClient()
    with pytest.raises(_Recorded):
        call(api)
    return api.urls[-1][1]


NS, NAME = "team-a", "llama-8b.eagle3"
CASES = [
    (k8s.pods(NS, NAME), lambda a: client.CoreV1Api(a).read_namespaced_pod(NAME, NS)),
    (k8s.pods(NS), lambda a: client.CoreV1Api(a).list_namespaced_pod(NS)),
    (k8s.deployment(NS, NAME), lambda a: client.AppsV1Api(a).read_namespaced_deployment(NAME, NS)),
    (k8s.Ref("v1", "ConfigMap", NS, NAME), lambda a: client.CoreV1Api(a).read_namespaced_config_map(NAME, NS)),
    (k8s.Ref("v1", "Service", NS, NAME), lambda a: client.CoreV1Api(a).read_namespaced_service(NAME, NS)),
    (k8s.Ref("v1", "Event", NS), lambda a: client.CoreV1Api(a).list_namespaced_event(NS)),
    (k8s.NODES, lambda a: client.CoreV1Api(a).list_node()),
    (k8s.sdd(NS, NAME), lambda a: client.CustomObjectsApi(a).get_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, NAME)),
]


@pytest.mark.parametrize("ref,call", CASES, ids=[f"{r.kind}-{bool(r.name)}" for r, _ in CASES])
def test_rest_path_is_the_official_clients(ref, call):
    assert k8s.rest_path(ref) == official_path(call)


def test_status_subresource_path():
    expected = official_path(lambda a: client.CustomObjectsApi(a).replace_namespaced_custom_object_status(
        GROUP, VERSION, NS, PLURAL, NAME, {}))
    assert k8s.rest_path(k8s.sdd(NS, NAME), "status") == expected


def test_ref_of_an_object_and_its_collection():
    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "namespace": NS}}
    assert k8s.Ref.of(obj) == k8s.deployment(NS, NAME)
    assert k8s.Ref.of(obj).collection() == k8s.Ref("apps/v1", "Deployment", NS)
    assert k8s.Ref("v1", "Pod", NS).named("p") == k8s.pods(NS, "p")


class FakeResponse:
    def __init__(self, status, body):
        self.status, self.data = status, json.dumps(body).encode()
        self.reason, self.headers = "", {}

    def getheaders(self):
        return self.headers

    def read(self):
        return self.data


class ReplyingApiClient(client.ApiClient):
    def __init__(self, status, body):
        super().__init__(client.Configuration(host="https://api.test"))
        self.reply = FakeResponse(status, body)
        self.calls = []

    def call_api(self, method, url, *args, **kwargs):
        self.calls.append((method, url))
        if self.reply.status >= 400:
            raise client.ApiException(http_resp=self.reply)
        return self.reply


def test_api_errors_carry_the_status_message_and_reason():
    status = {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
              "message": 'pods "p" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true'}
    api = ReplyingApiClient(403, status)
    kube = k8s.Kube(api)
    with pytest.raises(k8s.ApiError) as err:
        kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": NS}})
    assert (err.value.status, err.value.reason, err.value.message) == (403, "Forbidden", status["message"])
    assert api.calls == [("POST", f"https://api.test/api/v1/namespaces/{NS}/pods")] and kube.requests == 1


def test_get_of_a_missing_object_is_none_and_apply_is_one_patch():
    api = ReplyingApiClient(404, {"kind": "Status", "reason": "NotFound", "code": 404, "message": "not found"})
    assert k8s.Kube(api).get(k8s.pods(NS, "p")) is None
    api = ReplyingApiClient(200, {"kind": "Service"})
    k8s.Kube(api).apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": NS}})
    assert api.calls == [("PATCH", f"https://api.test/api/v1/namespaces/{NS}/services/s?fieldManager="
                                   "specdecode-operator&force=true")]


class _Answer:
    def __init__(self, status: int, data: dict):
        self.status, self.data = status, json.dumps(data).encode()

    def read(self):
        return self.data


class ThrottlingApiClient(client.ApiClient):
    """Answers 429 with ``Retry-After`` the first ``throttle`` times, then 200."""

    def __init__(self, throttle: int, retry_after: str = "3"):
        super().__init__(client.Configuration(host="https://api.test"))
        self.throttle, self.retry_after, self.calls = throttle, retry_after, 0

    def call_api(self, method, url, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.throttle:
            exc = client.ApiException(status=429, reason="Too Many Requests")
            exc.headers = {"Retry-After": self.retry_after}
            exc.body = json.dumps({"kind": "Status", "code": 429, "reason": "TooManyRequests",
                                   "message": "too many requests, please try again later"}).encode()
            raise exc
        return _Answer(200, {"kind": "Pod", "metadata": {"name": NAME}})


def test_a_throttled_request_is_resent_after_the_wait_the_server_asks(monkeypatch):
    waits = []
    monkeypatch.setattr(k8s.time, "sleep", waits.append)
    api = ThrottlingApiClient(throttle=2)
    kube = k8s.Kube(api)
    assert kube.get(k8s.pods(NS, NAME))["metadata"]["name"] == NAME
    assert api.calls == 3 and waits == [3.0, 3.0]
    assert kube.throttled == 2 and kube.requests == 3  # every request sent counts


def test_retry_after_is_bounded_and_defaults_when_absent_or_garbled():
    low, high = k8s.RETRY_AFTER_S
    assert k8s.retry_after({"Retry-After": "600"}) == high
    assert k8s.retry_after({"Retry-After": "0"}) == low
    assert k8s.retry_after({}) == low and k8s.retry_after(None) == low
    assert k8s.retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) == low


def test_a_request_throttled_past_the_retries_raises_its_429(monkeypatch):
    monkeypatch.setattr(k8s.time, "sleep", lambda _s: None)
    api = ThrottlingApiClient(throttle=k8s.THROTTLED_RETRIES + 1)
    with pytest.raises(k8s.ApiError) as caught:
        k8s.Kube(api).get(k8s.pods(NS, NAME))
    assert caught.value.status == 429 and api.calls == k8s.THROTTLED_RETRIES + 1
