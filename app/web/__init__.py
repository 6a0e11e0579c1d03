"""The web page: server-rendered Jinja2 templates and a few small ES modules, served under /ui.

`pages` serves the pages and their live fragments, `session` signs a browser in and out, `views`
renders templates and formats values. Static assets (CSS, scripts, the vendored three.js, and
Swagger UI for the API docs page) live in `static/` and are served from /ui/static/ without a key.
See docs/ui.md.
"""
