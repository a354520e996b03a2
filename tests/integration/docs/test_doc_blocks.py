"""What the docs test takes for a page's runnable blocks (tests/support/doc_blocks.py)."""

from tests.support.doc_blocks import blocks

PAGE = """# A page

Start it:

    python -m gateway --config backends.yaml
    curl -d '{
      "model": "m"}' http://127.0.0.1:8080/v1/chat/completions

- a list item with an indented paragraph:

    not code, the list item's text

<!-- not run: needs a GPU -->
```bash
vllm serve model --port 8000
```

```text
 client --> Envoy
```

```python
print("hi")
```

```yaml
a: 1
```
"""


def test_shell_python_and_marked_blocks_are_found_and_nothing_else():
    found = blocks("page.md", PAGE)
    assert [(b.lang, b.skip) for b in found] == [("sh", None), ("sh", "needs a GPU"), ("python", None)]
    assert found[0].commands == ["python -m gateway --config backends.yaml",
                                 "curl -d '{\n  \"model\": \"m\"}' http://127.0.0.1:8080/v1/chat/completions"]
    assert found[0].line == 5 and found[1].commands == ["vllm serve model --port 8000"]
