"""An in-process fake of the parts of Grafana's HTTP API that `ringtrain dashboards push` uses.

No Grafana server can be installed here, and grafana-client talks through niquests, which
`responses` and `requests-mock` do not intercept; so the tests run the real client against this
server on 127.0.0.1 (port 0, one thread). It keeps folders, data sources, dashboards and alert
rules in dicts, checks the Authorization header on every request, adds the fields Grafana adds
(ids, versions, provenance), and refuses what Grafana refuses: a dashboard in a missing folder,
an alert rule whose folder, data source or condition does not exist, a duplicate uid or name.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

Json = dict[str, Any]
Reply = tuple[int, Optional[Any]]
EXPRESSION_DATASOURCE = "__expr__"


class FakeGrafana:
    def __init__(
        self, token: str = "secret-token", user: str = "admin", password: str = "admin-pw", sub_path: str = ""
    ) -> None:
        """``sub_path`` serves the API under it, as a Grafana behind a reverse proxy at /grafana."""
        self.token = token
        self.sub_path = sub_path
        self.basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.folders: dict[str, Json] = {}
        self.datasources: dict[str, Json] = {}
        self.dashboards: dict[str, Json] = {}
        self.alert_rules: dict[str, Json] = {}
        self.requests: list[tuple[str, str]] = []
        # Set to an HTTP status to refuse every write with it (e.g. 403 for a Viewer's token).
        self.refuse_writes: Optional[int] = None
        self._next_id = 1
        self._lock = threading.Lock()
        self._routes: list[tuple[str, re.Pattern[str], Callable[..., Reply]]] = [
            ("GET", re.compile(r"/api/folders/([^/]+)"), self._get_folder),
            ("POST", re.compile(r"/api/folders"), self._create_folder),
            ("PUT", re.compile(r"/api/folders/([^/]+)"), self._update_folder),
            ("GET", re.compile(r"/api/datasources/uid/([^/]+)"), self._get_datasource),
            ("POST", re.compile(r"/api/datasources"), self._create_datasource),
            ("PUT", re.compile(r"/api/datasources/uid/([^/]+)"), self._update_datasource),
            ("GET", re.compile(r"/api/dashboards/uid/([^/]+)"), self._get_dashboard),
            ("POST", re.compile(r"/api/dashboards/db"), self._save_dashboard),
            ("GET", re.compile(r"/api/v1/provisioning/alert-rules/([^/]+)"), self._get_rule),
            ("POST", re.compile(r"/api/v1/provisioning/alert-rules"), self._create_rule),
            ("PUT", re.compile(r"/api/v1/provisioning/alert-rules/([^/]+)"), self._update_rule),
        ]
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        # A short poll interval: shutdown() waits up to one interval.
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}{self.sub_path}"

    def __enter__(self) -> FakeGrafana:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def state(self) -> Json:
        """Everything stored, as a deep copy to compare before and after."""
        with self._lock:
            return copy.deepcopy(
                {
                    "folders": self.folders,
                    "datasources": self.datasources,
                    "dashboards": self.dashboards,
                    "alert_rules": self.alert_rules,
                }
            )

    def writes(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path in self.requests if method != "GET"]

    def handle(self, method: str, path: str, authorization: str, body: Optional[Any]) -> Reply:
        with self._lock:
            self.requests.append((method, path))
            if authorization not in (f"Bearer {self.token}", self.basic):
                return 401, {"message": "invalid API key"}
            if not path.startswith(self.sub_path):
                return 404, {"message": "Not found"}
            for route_method, pattern, action in self._routes:
                match = pattern.fullmatch(path[len(self.sub_path) :])
                if route_method == method and match:
                    if method != "GET" and self.refuse_writes:
                        return self.refuse_writes, {"message": "You'll need additional permissions"}
                    return action(body, *match.groups())
            return 404, {"message": "Not found"}

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    # Folders
    def _get_folder(self, body: Any, uid: str) -> Reply:
        return (200, self.folders[uid]) if uid in self.folders else (404, {"message": "folder not found"})

    def _create_folder(self, body: Json) -> Reply:
        uid, title = body.get("uid"), body.get("title")
        if not uid or not title:
            return 400, {"message": "uid and title are required"}
        if uid in self.folders or any(f["title"] == title for f in self.folders.values()):
            return 409, {"message": "a folder with the same name already exists"}
        self.folders[uid] = {"id": self._id(), "uid": uid, "title": title, "version": 1, "url": f"/dashboards/f/{uid}/"}
        return 200, self.folders[uid]

    def _update_folder(self, body: Json, uid: str) -> Reply:
        if uid not in self.folders:
            return 404, {"message": "folder not found"}
        folder = self.folders[uid]
        folder.update(title=body.get("title", folder["title"]), version=folder["version"] + 1)
        return 200, folder

    # Data sources
    def _get_datasource(self, body: Any, uid: str) -> Reply:
        return (200, self.datasources[uid]) if uid in self.datasources else (404, {"message": "Data source not found"})

    def _create_datasource(self, body: Json) -> Reply:
        uid = body.get("uid")
        if not uid or not body.get("name") or not body.get("type"):
            return 400, {"message": "uid, name and type are required"}
        if uid in self.datasources or any(d["name"] == body["name"] for d in self.datasources.values()):
            return 409, {"message": "data source with the same name already exists"}
        stored = {"id": self._id(), "orgId": 1, "basicAuth": False, "readOnly": False, "version": 1, **body}
        self.datasources[uid] = stored
        return 200, {"datasource": stored, "id": stored["id"], "message": "Datasource added", "name": body["name"]}

    def _update_datasource(self, body: Json, uid: str) -> Reply:
        if uid not in self.datasources:
            return 404, {"message": "Data source not found"}
        old = self.datasources[uid]
        # Grafana replaces the data source with the body it is sent.
        self.datasources[uid] = {"id": old["id"], "orgId": 1, "version": old["version"] + 1, **body}
        return 200, {"datasource": self.datasources[uid], "message": "Datasource updated"}

    # Dashboards
    def _get_dashboard(self, body: Any, uid: str) -> Reply:
        if uid not in self.dashboards:
            return 404, {"message": "Dashboard not found"}
        entry = self.dashboards[uid]
        return 200, {"dashboard": entry["dashboard"], "meta": {"folderUid": entry["folderUid"], "slug": uid}}

    def _save_dashboard(self, body: Json) -> Reply:
        board, folder = body.get("dashboard") or {}, body.get("folderUid")
        uid = board.get("uid")
        if not uid or not board.get("title"):
            return 400, {"message": "Dashboard title and uid are required"}
        if folder not in self.folders:
            return 400, {"message": "folder not found"}
        old = self.dashboards.get(uid)
        if old is not None and not body.get("overwrite"):
            return 412, {"status": "name-exists", "message": "A dashboard with the same uid already exists"}
        number = old["dashboard"]["id"] if old else self._id()
        version = old["dashboard"]["version"] + 1 if old else 1
        self.dashboards[uid] = {"dashboard": {**board, "id": number, "version": version}, "folderUid": folder}
        return 200, {"id": number, "uid": uid, "status": "success", "version": version, "url": f"/d/{uid}"}

    # Alert rules
    def _get_rule(self, body: Any, uid: str) -> Reply:
        # Grafana answers a missing rule with an empty 404.
        return (200, self.alert_rules[uid]) if uid in self.alert_rules else (404, None)

    def _check_rule(self, rule: Json) -> Optional[Reply]:
        if rule.get("folderUID") not in self.folders:
            return 400, {"message": f"folder {rule.get('folderUID')} does not exist"}
        ref_ids = set()
        for query in rule.get("data", []):
            source = query.get("datasourceUid")
            if source != EXPRESSION_DATASOURCE and source not in self.datasources:
                return 400, {"message": f"data source {source} does not exist"}
            ref_ids.add(query.get("refId"))
        if rule.get("condition") not in ref_ids:
            return 400, {"message": "condition refers to no query"}
        if not rule.get("title") or not rule.get("ruleGroup") or not rule.get("for"):
            return 400, {"message": "title, ruleGroup and for are required"}
        return None

    def _create_rule(self, body: Json) -> Reply:
        refused = self._check_rule(body)
        if refused:
            return refused
        if body.get("uid") in self.alert_rules:
            return 409, {"message": "a rule with this uid already exists"}
        stored = {"id": self._id(), "orgID": 1, "provenance": "api", "updated": "2024-01-01T00:00:00Z", **body}
        self.alert_rules[body["uid"]] = stored
        return 201, stored

    def _update_rule(self, body: Json, uid: str) -> Reply:
        if uid not in self.alert_rules:
            return 404, None
        refused = self._check_rule(body)
        if refused:
            return refused
        old = self.alert_rules[uid]
        updated = {"id": old["id"], "orgID": 1, "provenance": "api", "updated": "2024-01-02T00:00:00Z"}
        self.alert_rules[uid] = {**updated, **body}
        return 200, self.alert_rules[uid]


def _handler(fake: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            authorization = self.headers.get("Authorization", "")
            status, reply = fake.handle(self.command, self.path.split("?")[0], authorization, body)
            data = b"" if reply is None else json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = _serve

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the tests assert on the fake's state, not its log."""

    return Handler
