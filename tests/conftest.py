import pytest


@pytest.fixture
def write(tmp_path):
    """Write a file under tmp_path and return its path."""

    def _write(name: str, text: str | bytes):
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text)
        return p

    return _write
