"""The package index on loopback the environment tests use (tests/pyindex.py): PEP 503 pages,
PEP 658 metadata beside each wheel, every file it serves counted (no root needed)."""

from __future__ import annotations

import hashlib
import re
import urllib.request
import zipfile

from pyindex import PackageIndex, normalize


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def test_an_index_serves_its_wheels_by_project_and_counts_each_file(tmp_path):
    with PackageIndex(tmp_path / "wheels") as index:
        wheel = index.add("tfa-alpha", "1.0", requires=["tfa-beta>=1"])
        index.add("tfa_beta", "2.0")
        root = _get(index.url).decode()
        assert 'href="/simple/tfa-alpha/"' in root and 'href="/simple/tfa-beta/"' in root
        page = _get(index.url + "TFA.Alpha/").decode()          # names are normalized
        href, digest = re.search(r'href="([^"#]+)#sha256=([0-9a-f]{64})"', page).groups()
        assert "data-dist-info-metadata" in page
        assert index.served() == {}                              # pages are not files
        data = _get(index.url.removesuffix("/simple/") + href)
        assert hashlib.sha256(data).hexdigest() == digest == \
            hashlib.sha256(wheel.read_bytes()).hexdigest()
        _get(index.url.removesuffix("/simple/") + href + ".metadata")
        _get(index.url.removesuffix("/simple/") + href)
        assert index.served() == {wheel.name: 2, wheel.name + ".metadata": 1}
        assert index.pages() == {"tfa-alpha": 1}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert {"tfa_alpha.py", "tfa_alpha-1.0.dist-info/METADATA",
                "tfa_alpha-1.0.dist-info/RECORD"} <= names
        assert b"Requires-Dist: tfa-beta>=1" in zf.read("tfa_alpha-1.0.dist-info/METADATA")


def test_a_project_it_does_not_have_is_a_404(tmp_path):
    import urllib.error

    with PackageIndex(tmp_path) as index:
        try:
            _get(index.url + "nothing-here/")
        except urllib.error.HTTPError as err:
            assert err.code == 404
        else:
            raise AssertionError("no 404")
    assert normalize("A_b.C") == "a-b-c"
