"""The local web chat: the page (static/, vendored front-end libraries with their licenses)
and `POST /api/chat` on the gateway's HTTP server."""
