"""tpufab.cloud.storage against the simulated Cloud Storage (in-process, in memory), and the
simulated Cloud Storage's own additions: generation preconditions (gcp-storage-emulator
ignores them), testPermissions with denied permissions, bucket settings, paged listings."""

from __future__ import annotations

import io
import json
import threading
from email.message import Message
from urllib.error import HTTPError

import pytest
from helpers import storage_emulator

from tpufab.cloud.planes.calls import RetryPolicy
from tpufab.cloud.storage import (
    Appender,
    PreconditionFailed,
    Storage,
    StorageError,
    StorageNotFound,
    check_bucket_name,
    chunks,
)
from tpufab.errors import ConfigError


@pytest.fixture(scope="module")
def gcs():
    with storage_emulator() as emulator:
        yield emulator


@pytest.fixture()
def bucket(gcs, request):
    name = "t-" + request.node.name.replace("_", "-").lower()[:50].strip("-")
    gcs.create_bucket(name)
    yield name
    gcs.httpd.denied_permissions.clear()


@pytest.fixture()
def store(gcs):
    return Storage(gcs.url)


def test_a_bucket_is_made_with_uniform_access_and_no_public_access(gcs, store):
    made, created = store.ensure_bucket("t-made", project="p", labels={"tpufab": "supervisor"})
    assert created
    got = store.bucket("t-made")
    assert got["iamConfiguration"]["uniformBucketLevelAccess"]["enabled"] is True
    assert got["iamConfiguration"]["publicAccessPrevention"] == "enforced"
    assert got["softDeletePolicy"]["retentionDurationSeconds"] == "0"
    assert got["labels"] == {"tpufab": "supervisor"}
    assert store.ensure_bucket("t-made", project="p")[1] is False       # there: used as it is
    with pytest.raises(StorageError, match="already exists"):
        store.create_bucket("t-made", project="p")
    assert store.bucket("t-never-made") is None


def test_a_bucket_that_may_not_be_created_is_the_refusal_with_its_role(gcs, store):
    gcs.deny_permission("storage.buckets.create")
    try:
        with pytest.raises(StorageError, match="refused to create bucket gs://t-refused .*"
                                               "storage.buckets.create.*roles/storage.admin"):
            store.ensure_bucket("t-refused", project="p")
    finally:
        gcs.allow_permission("storage.buckets.create")
    assert store.bucket("t-refused") is None


def test_bucket_names_are_checked_before_any_call():
    assert check_bucket_name("my-project-tpufab") == "my-project-tpufab"
    for bad in ("UPPER", "a", "-dash", "has space", "a..b", "x" * 64):
        with pytest.raises(ConfigError, match="is not a Cloud Storage bucket name"):
            check_bucket_name(bad)


def test_if_generation_match_zero_writes_only_a_new_object(store, bucket):
    first = store.put(bucket, "spec.json", b"one", if_generation_match=0)
    with pytest.raises(PreconditionFailed, match="exists already"):
        store.put(bucket, "spec.json", b"two", if_generation_match=0)
    data, blob = store.read(bucket, "spec.json")
    assert (data, blob.generation) == (b"one", first.generation)


def test_a_write_at_a_stale_generation_is_refused_and_leaves_the_newer_one(store, bucket):
    first = store.put(bucket, "state.json", b"v1", if_generation_match=0)
    second = store.put(bucket, "state.json", b"v2", if_generation_match=first.generation)
    assert second.generation != first.generation
    with pytest.raises(PreconditionFailed, match=f"since generation {first.generation}"):
        store.put(bucket, "state.json", b"stale", if_generation_match=first.generation)
    with pytest.raises(PreconditionFailed):          # a generation that never existed
        store.put(bucket, "missing.json", b"x", if_generation_match=12345)
    assert store.stat(bucket, "missing.json") is None
    assert store.read(bucket, "state.json")[0] == b"v2"


def test_reads_and_deletes_honour_preconditions(store, bucket):
    blob = store.put(bucket, "o", b"data", if_generation_match=0)
    assert store.read(bucket, "o", if_generation_match=blob.generation)[0] == b"data"
    with pytest.raises(PreconditionFailed):
        store.read(bucket, "o", if_generation_match=blob.generation + 1)
    with pytest.raises(PreconditionFailed):          # 304: it is at that generation
        store.read(bucket, "o", if_generation_not_match=blob.generation)
    with pytest.raises(PreconditionFailed):
        store.delete(bucket, "o", if_generation_match=blob.generation - 1)
    assert store.stat(bucket, "o").generation == blob.generation
    assert store.delete(bucket, "o", if_generation_match=blob.generation) is True
    assert store.delete(bucket, "o") is False
    with pytest.raises(StorageNotFound, match=f"gs://{bucket}/o does not exist"):
        store.read(bucket, "o")


def test_metadata_updates_honour_metageneration(store, bucket):
    blob = store.put(bucket, "m", b"x", if_generation_match=0)
    patched = store.set_metadata(bucket, "m", {"holder": "a"},
                                 if_metageneration_match=blob.metageneration)
    assert patched.metageneration == blob.metageneration + 1
    assert dict(store.stat(bucket, "m").metadata) == {"holder": "a"}
    with pytest.raises(PreconditionFailed):
        store.set_metadata(bucket, "m", {"holder": "b"},
                           if_metageneration_match=blob.metageneration)
    with pytest.raises(PreconditionFailed):
        store.set_metadata(bucket, "m", {"holder": "b"}, if_generation_match=1)
    assert dict(store.stat(bucket, "m").metadata) == {"holder": "a"}


def test_of_many_writers_racing_for_one_new_object_exactly_one_wins(store, bucket):
    won, lost = [], []
    start = threading.Barrier(12)

    def racer(i: int) -> None:
        start.wait()
        try:
            store.put(bucket, "race", f"writer {i}".encode(), if_generation_match=0)
            won.append(i)
        except PreconditionFailed:
            lost.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1 and len(lost) == 11
    assert store.read(bucket, "race")[0] == f"writer {won[0]}".encode()


def test_listing_by_prefix_with_folders_offsets_and_pages(store, bucket):
    for name in ("a/1", "a/2", "a/3/x", "a/4", "a/5", "b/1"):
        store.put(bucket, name, b".", if_generation_match=0)
    assert [b.name for b in store.list(bucket, "a/").blobs] == ["a/1", "a/2", "a/3/x", "a/4",
                                                                  "a/5"]
    folded = store.list(bucket, "a/", delimiter="/")
    assert [b.name for b in folded.blobs] == ["a/1", "a/2", "a/4", "a/5"]
    assert folded.prefixes == ["a/3/"]
    paged = store.list(bucket, "a/", page_size=2)       # three pages, followed to the end
    assert [b.name for b in paged.blobs] == ["a/1", "a/2", "a/3/x", "a/4", "a/5"]
    assert [b.name for b in store.list(bucket, "a/", start_offset="a/4").blobs] == ["a/4",
                                                                                     "a/5"]
    with pytest.raises(StorageNotFound, match="Bucket gs://t-nowhere does not exist"):
        store.list("t-nowhere")


def test_refusals_and_permissions_are_one_sentence_with_the_role(gcs, store, bucket):
    store.put(bucket, "there", b"x", if_generation_match=0)
    wanted = ["storage.objects.get", "storage.objects.create", "storage.objects.delete"]
    assert store.test_permissions(bucket, wanted) == set(wanted)
    gcs.deny_permission("storage.objects.delete", bucket)
    assert store.test_permissions(bucket, wanted) == set(wanted) - {"storage.objects.delete"}
    store.put(bucket, "new", b"x", if_generation_match=0)       # creating needs no delete
    with pytest.raises(StorageError, match="refused to write .*storage.objects.delete.*"
                                           "roles/storage.objectUser"):
        store.put(bucket, "there", b"y")                    # overwriting does, as on GCS
    gcs.deny(bucket)
    try:
        with pytest.raises(StorageError, match=f"refused to read gs://{bucket}/there \\(403 "
                                               "forbidden.*roles/storage.objectViewer"):
            store.stat(bucket, "there")
    finally:
        gcs.allow(bucket)
    with pytest.raises(StorageNotFound):
        store.test_permissions("t-nowhere", wanted)


def test_a_media_read_says_its_generation(gcs, bucket):
    from urllib.request import urlopen

    blob = Storage(gcs.url).put(bucket, "g", b"abc", if_generation_match=0)
    with urlopen(f"{gcs.url}/storage/v1/b/{bucket}/o/g?alt=media") as resp:
        assert resp.headers["x-goog-generation"] == str(blob.generation)
        assert resp.read() == b"abc"


def test_appended_chunks_read_back_in_order_and_a_second_writer_is_refused(store, bucket):
    log = Appender(store, bucket, "logs/1/w0/")
    for i in range(12):
        log.append(f"line {i}\n".encode())
    assert log.append(b"") is None                           # nothing to write: no object
    got = list(chunks(store, bucket, "logs/1/w0/"))
    assert b"".join(data for _, data in got) == b"".join(f"line {i}\n".encode()
                                                         for i in range(12))
    assert [name for name, _ in chunks(store, bucket, "logs/1/w0/", after=got[9][0])] == \
        [got[10][0], got[11][0]]
    resumed = Appender(store, bucket, "logs/1/w0/")         # counts what is there first
    resumed.append(b"line 12\n")
    assert resumed.next_index == 13
    stale = Appender(store, bucket, "logs/1/w0/", next_index=5)
    with pytest.raises(PreconditionFailed, match="Another writer appends"):
        stale.append(b"not mine\n")
    retried = Appender(store, bucket, "logs/1/w0/", next_index=12)   # its first try landed
    retried.append(b"line 12\n")
    assert retried.next_index == 13


# -- retries and credentials, with a fake endpoint (no emulator)

class FakeOpener:
    """Answers each request with the next of ``answers`` (status, body), recording them."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests = []

    def open(self, request, timeout=None):
        self.requests.append(request)
        status, body = self.answers.pop(0)
        if status >= 400:
            raise HTTPError(request.full_url, status, "x", Message(), io.BytesIO(body))
        return _Response(status, body)


class _Response(io.BytesIO):
    def __init__(self, status, body):
        super().__init__(body)
        self.status = status
        self.headers = Message()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


OBJECT = json.dumps({"name": "o", "generation": "7"}).encode()
QUICK = RetryPolicy(attempts=4, total_seconds=60, initial=0.01, maximum=0.01, jitter=0)


def test_safe_calls_are_retried_on_transient_failures_and_others_are_not():
    opener = FakeOpener([(503, b"{}"), (429, b"{}"), (200, OBJECT)])
    store = Storage("http://127.0.0.1:1", opener=opener, policy=QUICK, sleep=lambda s: None)
    assert store.put("b", "o", b"x", if_generation_match=3).generation == 7
    assert len(opener.requests) == 3
    opener = FakeOpener([(503, b"{}"), (200, OBJECT)])
    store = Storage("http://127.0.0.1:1", opener=opener, policy=QUICK, sleep=lambda s: None)
    with pytest.raises(StorageError, match="kept failing to write gs://b/o \\(503"):
        store.put("b", "o", b"x")                    # unconditional: tried once
    assert len(opener.requests) == 1
    quota = json.dumps({"error": {"code": 429, "message": "Rate exceeded", "errors": [
        {"reason": "rateLimitExceeded"}]}}).encode()
    opener = FakeOpener([(429, quota)] * 4)
    store = Storage("http://127.0.0.1:1", opener=opener, policy=QUICK, sleep=lambda s: None)
    with pytest.raises(StorageError, match="over a quota or rate limit .*rateLimitExceeded: "
                                           "Rate exceeded"):
        store.stat("b", "o")
    assert len(opener.requests) == 4


def test_an_endpoint_that_does_not_answer_is_one_sentence():
    store = Storage("http://127.0.0.1:9", policy=QUICK, sleep=lambda s: None, timeout=2)
    with pytest.raises(StorageError, match="Cloud Storage at http://127.0.0.1:9 does not "
                                           "answer .*storage_endpoint"):
        store.bucket("b")


def test_google_endpoints_get_the_credentials_token():
    class Creds:
        valid, token, refreshed = False, None, 0

        def refresh(self, request):
            self.valid, self.token = True, "tok-1"
            self.refreshed += 1

    creds, opener = Creds(), FakeOpener([(200, OBJECT), (200, OBJECT)])
    store = Storage(None, credentials=creds, opener=opener, policy=QUICK)
    store.stat("b", "o")
    store.stat("b", "o")
    assert opener.requests[0].full_url.startswith("https://storage.googleapis.com/storage/v1/")
    assert [r.get_header("Authorization") for r in opener.requests] == ["Bearer tok-1"] * 2
    assert creds.refreshed == 1
    local = FakeOpener([(200, OBJECT)])
    Storage("http://127.0.0.1:1", opener=local).stat("b", "o")
    assert local.requests[0].get_header("Authorization") is None


# -- the simulated Cloud Storage's precondition rule, as data

@pytest.mark.parametrize(("obj", "query", "kind", "status"), [
    (None, {"ifGenerationMatch": ["0"]}, "write", None),
    ({"generation": "5"}, {"ifGenerationMatch": ["0"]}, "write", 412),
    ({"generation": "5"}, {"ifGenerationMatch": ["5"]}, "write", None),
    ({"generation": "5"}, {"ifGenerationMatch": ["4"]}, "write", 412),
    (None, {"ifGenerationMatch": ["4"]}, "write", 412),
    ({"generation": "5"}, {"ifGenerationNotMatch": ["5"]}, "write", 412),
    ({"generation": "5"}, {"ifGenerationNotMatch": ["5"]}, "read", 304),
    ({"generation": "5"}, {"ifGenerationNotMatch": ["4"]}, "read", None),
    (None, {"ifGenerationNotMatch": ["0"]}, "write", 412),       # no live object: fails
    ({"generation": "5", "metageneration": "2"}, {"ifMetagenerationMatch": ["2"]}, "update", None),
    ({"generation": "5", "metageneration": "2"}, {"ifMetagenerationMatch": ["1"]}, "update", 412),
    ({"generation": "5", "metageneration": "2"}, {"ifMetagenerationNotMatch": ["2"]}, "read", 304),
    ({"generation": "5"}, {"ifGenerationMatch": ["4"], "ifGenerationNotMatch": ["5"]}, "read", 412),
    ({"generation": "5"}, {}, "write", None),
])
def test_the_simulated_storages_preconditions(obj, query, kind, status):
    from tpufab.sim.storage import precondition_status

    assert precondition_status(obj, query, kind) == status
