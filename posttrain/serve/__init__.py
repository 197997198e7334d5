"""Services other clients drive: ``posttrain serve --tinker`` answers the Tinker API (the official
``tinker`` SDK and tinker-cookbook train on posttrain locally; docs/tinker.md)."""
