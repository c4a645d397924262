"""The one settings module. Every value comes from the environment; `.env.example` lists them
all. Defaults run locally only with DEBUG on: with DEBUG off (the default) the process refuses
to start while a secret is unset or still a published development value, and the security
settings default to HTTPS-only."""

import os
from pathlib import Path

import dj_database_url
from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def env(name, default=""):
    return os.environ.get(name, default)


def env_bool(name, default=False):
    """An empty or unset variable is the default; anything but the words above is refused, so
    a typo such as DEBUG=flase cannot silently read as false."""
    value = env(name).strip().lower()
    if not value:
        return default
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ImproperlyConfigured(
        f"{name}={env(name)!r} is not a boolean: use one of {', '.join(TRUE_WORDS + FALSE_WORDS)}"
    )


def env_int(name, default, *, minimum=None, why=""):
    """An empty or unset variable is the default; anything but a whole number (at least
    `minimum`, when given) is refused with the variable's name (and `why` the minimum)."""
    value = env(name).strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={env(name)!r} is not an integer") from None
    if minimum is not None and number < minimum:
        reason = f": {why}" if why else ""
        raise ImproperlyConfigured(f"{name}={number} is below its minimum, {minimum}{reason}")
    return number


def env_list(name, default=""):
    """A comma-separated list; blanks around and between items are dropped."""
    return [item.strip() for item in env(name, default).split(",") if item.strip()]


DEBUG = env_bool("DEBUG", False)

# Development secrets, published in `.env.example`: accepted only with DEBUG on.
DEVELOPMENT_SECRETS = {
    "SECRET_KEY": "dev-only-secret-key-change-me-in-production-0123456789",
    # Keyed hash for API keys: a leaked SECRET_KEY must not let anyone check guessed API keys.
    "API_KEY_HMAC_SECRET": "dev-only-api-key-hmac-secret-change-me",
    # Fernet key (urlsafe base64 of 32 bytes) encrypting playground key secrets at rest.
    "PLAYGROUND_KEY_ENCRYPTION_KEY": "ZGV2LW9ubHktcGxheWdyb3VuZC1rZXktMzJieXRlcyE=",
}


def env_secrets():
    """The secrets from the environment, development values filled in only with DEBUG on.
    Without DEBUG, refuses to start (naming every variable at fault) while one is unset, is a
    published development value, or is the same as another."""
    values = {name: env(name).strip() for name in DEVELOPMENT_SECRETS}
    if DEBUG:
        values = {name: value or DEVELOPMENT_SECRETS[name] for name, value in values.items()}
    else:
        faults = [
            f"{name} is unset" if not value else f"{name} is the published development value"
            for name, value in values.items()
            if not value or value == DEVELOPMENT_SECRETS[name]
        ]
        if len(set(values.values())) < len(values) and not faults:
            faults.append(f"{', '.join(values)} must all be different")
        if faults:
            raise ImproperlyConfigured(
                f"DEBUG is off and {'; '.join(faults)}: generate each secret "
                "(see the production section of .env.example)."
            )
    try:
        Fernet(values["PLAYGROUND_KEY_ENCRYPTION_KEY"].encode())
    except ValueError:
        raise ImproperlyConfigured(
            "PLAYGROUND_KEY_ENCRYPTION_KEY is not a Fernet key (urlsafe base64 of 32 bytes)"
        ) from None
    return values


_secrets = env_secrets()
SECRET_KEY = _secrets["SECRET_KEY"]
API_KEY_HMAC_SECRET = _secrets["API_KEY_HMAC_SECRET"]
PLAYGROUND_KEY_ENCRYPTION_KEY = _secrets["PLAYGROUND_KEY_ENCRYPTION_KEY"]

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver" if DEBUG else "")
if not ALLOWED_HOSTS:
    raise ImproperlyConfigured("DEBUG is off and ALLOWED_HOSTS is unset: list the site's hosts")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")
SITE_URL = env("SITE_URL", "http://127.0.0.1:8000")

# HTTPS. Without DEBUG the site is HTTPS-only unless a variable says otherwise; behind a proxy
# that terminates TLS, SECURE_PROXY_SSL_HEADER names the header it sets ("HEADER,value").
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 365 * 24 * 3600, minimum=0)
# Both reach beyond this site (every subdomain; browsers' built-in lists): opt in explicitly.
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SECURE_PROXY_SSL_HEADER = tuple(env_list("SECURE_PROXY_SSL_HEADER")) or None
if SECURE_PROXY_SSL_HEADER is not None and len(SECURE_PROXY_SSL_HEADER) != 2:
    raise ImproperlyConfigured(
        f"SECURE_PROXY_SSL_HEADER={env('SECURE_PROXY_SSL_HEADER')!r} is not "
        '"HEADER,value" (e.g. "HTTP_X_FORWARDED_PROTO,https")'
    )

INSTALLED_APPS = [
    # django.contrib.admin, its site signing staff in through the login throttle and their
    # second factor (accounts/admin_site.py).
    "accounts.apps.AdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    # Staff's second factor (accounts/access.py): authenticator apps and recovery codes.
    "django_otp",
    "django_otp.plugins.otp_totp",
    "django_otp.plugins.otp_static",
    "accounts",
    "metering",
    "api",
    "api.jobs",
    "playground",
    "portal",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "acs_portal.staticfiles.StaticFilesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # request.user.is_verified(): whether this session passed the user's second factor.
    "django_otp.middleware.OTPMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "infra.database.DatabaseBusyMiddleware",
]

ROOT_URLCONF = "acs_portal.urls"
ASGI_APPLICATION = "acs_portal.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
            "builtins": ["accounts.templatetags.timestamps"],
        },
    },
]

# SQLite is only the zero-configuration default of `make run`; tests and production use
# PostgreSQL through DATABASE_URL.
DATABASES = {
    "default": dj_database_url.parse(env("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"))
}
# Connections each server process pools for the gateway's hot path (metering/sql.py); budget
# PostgreSQL's max_connections with it (docs/deploy.md).
ACS_DB_POOL_MAX_SIZE = env_int("ACS_DB_POOL_MAX_SIZE", 16, minimum=1)
# Django's own connections (pages, the other /v1 views, worker threads, Celery tasks) come
# from a pool of at most this many per process. Not persistent per-thread connections
# (CONN_MAX_AGE): under ASGI every request runs in a thread of its own, so each request left
# its connection open until garbage collection (63 page views held 45 connections).
ACS_ORM_POOL_MAX_SIZE = env_int("ACS_ORM_POOL_MAX_SIZE", 8, minimum=1)
# How long a page or task waits for one of them before the page answers 503.
ACS_ORM_POOL_TIMEOUT_SECONDS = env_int("ACS_ORM_POOL_TIMEOUT_SECONDS", 10, minimum=1)
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
else:
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": ACS_ORM_POOL_MAX_SIZE,
        "timeout": ACS_ORM_POOL_TIMEOUT_SECONDS,
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_USER_MODEL = "accounts.User"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/"

LANGUAGE_CODE = "en-gb"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = Path(env("STATIC_ROOT", str(BASE_DIR / "staticfiles")))
STATICFILES_DIRS = [BASE_DIR / "static"]
# WhiteNoise serves static files from the web process (acs_portal/staticfiles.py). With DEBUG
# it serves static/ as it is, changes included. Otherwise `manage.py collectstatic` must run
# first: it writes every file under a content-hashed name, with gzip and brotli copies, which
# are served with a ten-year `immutable` cache lifetime.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}
WHITENOISE_USE_FINDERS = WHITENOISE_AUTOREFRESH = DEBUG
# Pages link hashed names only ({% static %}); compressing the originals too would double
# collectstatic's work.
WHITENOISE_KEEP_ONLY_HASHED_FILES = True
MEDIA_ROOT = Path(env("MEDIA_ROOT", str(BASE_DIR / "media")))
MEDIA_URL = "/media/"

REDIS_URL = env("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = env("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_BEAT_SCHEDULE = {}

# With DEBUG, e-mail is printed by the process that sends it; otherwise it goes out by SMTP
# with the EMAIL_* variables.
EMAIL_BACKEND_PATH = env(
    "EMAIL_BACKEND",
    "django.core.mail.backends.console.EmailBackend"
    if DEBUG
    else "django.core.mail.backends.smtp.EmailBackend",
)
MAILERS = {"default": {"BACKEND": EMAIL_BACKEND_PATH}}
if EMAIL_BACKEND_PATH.endswith("smtp.EmailBackend"):
    MAILERS["default"]["OPTIONS"] = {
        "host": env("EMAIL_HOST", "localhost"),
        "port": env_int("EMAIL_PORT", 25, minimum=1),
        "username": env("EMAIL_HOST_USER"),
        "password": env("EMAIL_HOST_PASSWORD"),
        "use_tls": env_bool("EMAIL_USE_TLS", False),
    }
DEFAULT_FROM_EMAIL = env("DEFAULT_FROM_EMAIL", "ACS Portal <access@acs.local>")

# Default budgets (tokens) given at approval; staff change them per user or key.
ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS = env_int(
    "ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS", 5_000_000, minimum=0
)
ACS_DEFAULT_KEY_MONTHLY_TOKENS = env_int("ACS_DEFAULT_KEY_MONTHLY_TOKENS", 2_000_000, minimum=0)
ACS_DEFAULT_KEY_DAILY_TOKENS = env_int("ACS_DEFAULT_KEY_DAILY_TOKENS", 200_000, minimum=0)
ACS_DEFAULT_ACTIVATION_QUOTA = env_int("ACS_DEFAULT_ACTIVATION_QUOTA", 10_000, minimum=0)
ACS_DEFAULT_HARVEST_QUOTA = env_int("ACS_DEFAULT_HARVEST_QUOTA", 50, minimum=0)
# The same quotas for the whole account (all its keys together): without them, each new key
# brought a fresh quota of its own.
ACS_DEFAULT_ACCOUNT_ACTIVATION_QUOTA = env_int(
    "ACS_DEFAULT_ACCOUNT_ACTIVATION_QUOTA", 20_000, minimum=0
)
ACS_DEFAULT_ACCOUNT_HARVEST_QUOTA = env_int("ACS_DEFAULT_ACCOUNT_HARVEST_QUOTA", 100, minimum=0)
# Keys an account may hold at once (its playground key and revoked keys not counted); staff
# raise it per account (`User.key_limit`).
ACS_MAX_KEYS_PER_ACCOUNT = env_int("ACS_MAX_KEYS_PER_ACCOUNT", 10, minimum=1)

# The embedded engine, default upstream of the model registry.
ENGINE_URL = env("ENGINE_URL", "http://127.0.0.1:8001")
# Its weights directory, where `python -m engine weights` finds it (ACS_ENGINE_CACHE, else
# the engine's default): the first `migrate` records it on the engine's registry row.
ENGINE_WEIGHTS_DIR = str(
    Path(env("ACS_ENGINE_CACHE", "~/.cache/acs-engine/smollm2-135m")).expanduser()
)
# Where workers reach the public /v1 gateway (the playground calls it like any client).
GATEWAY_URL = env("GATEWAY_URL", "http://127.0.0.1:8000")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", "INFO")},
}

# --- Jobs (api/jobs): completion and harvest jobs -------------------------------------
# A worker holds a claimed job for this long; past it, the sweep assumes the worker died.
# Completion jobs: a non-streaming request must finish within 14 minutes.
ACS_COMPLETION_JOB_LEASE_SECONDS = env_int("ACS_COMPLETION_JOB_LEASE_SECONDS", 16 * 60, minimum=1)
# Harvest workers renew their lease after every batch of prompts.
ACS_HARVEST_JOB_LEASE_SECONDS = env_int("ACS_HARVEST_JOB_LEASE_SECONDS", 10 * 60, minimum=1)
ACS_JOB_MAX_ATTEMPTS = env_int("ACS_JOB_MAX_ATTEMPTS", 3, minimum=1)
ACS_COMPLETION_JOB_RETENTION_SECONDS = env_int(
    "ACS_COMPLETION_JOB_RETENTION_SECONDS", 24 * 3600, minimum=0
)
ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY = env_int("ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY", 2, minimum=1)
ACS_HARVEST_BATCH_SIZE = env_int("ACS_HARVEST_BATCH_SIZE", 8, minimum=1)
# How long signed harvest download URLs stay valid.
ACS_HARVEST_URL_MAX_AGE_SECONDS = env_int("ACS_HARVEST_URL_MAX_AGE_SECONDS", 3600, minimum=1)
CELERY_BEAT_SCHEDULE["jobs-sweep"] = {"task": "api.jobs.tasks.jobs_sweep_task", "schedule": 60.0}

# --- metering (budgets, usage) ---
CELERY_BEAT_SCHEDULE["metering.budget_release_stale"] = {
    "task": "metering.tasks.budget_release_stale_task",
    "schedule": 300.0,
}

# --- Playground (issue 5) -----------------------------------------------------------------
# Retries of a run after a transient API error (unreachable, 429/502/503 with Retry-After).
PLAYGROUND_RUN_MAX_RETRIES = env_int("PLAYGROUND_RUN_MAX_RETRIES", 3, minimum=0)
# A Retry-After longer than this (seconds; e.g. spend_cap's 3600) fails the run instead.
PLAYGROUND_RUN_MAX_RETRY_DELAY = env_int("PLAYGROUND_RUN_MAX_RETRY_DELAY", 30, minimum=0)
# A run queued or running longer than this (the API's 14-minute limit, plus margin) is failed.
PLAYGROUND_RUN_STUCK_SECONDS = env_int("PLAYGROUND_RUN_STUCK_SECONDS", 15 * 60, minimum=1)
# Runs of one group (a patching grid's cells, a sweep's scales) sent to the workers at a
# time; the next is sent as one finishes. The Celery queue is first in, first out: a grid of
# 512 cells sent at once made another user's run wait for all of them.
PLAYGROUND_GROUP_RUNS_IN_FLIGHT = env_int("PLAYGROUND_GROUP_RUNS_IN_FLIGHT", 4, minimum=1)
CELERY_BEAT_SCHEDULE["playground-runs-sweep"] = {
    "task": "playground.tasks.runs_sweep_task",
    "schedule": 60.0,
}
# The Jobs page's submissions stuck on their way to /v1 (portal/tasks.py), on the same clock.
CELERY_BEAT_SCHEDULE["job-submissions-sweep"] = {
    "task": "portal.tasks.job_submissions_sweep_task",
    "schedule": 60.0,
}

# --- /v1 gateway (api/) ---
# Every /v1 response carries X-Request-Id (outermost, so error pages get it too).
MIDDLEWARE = ["api.middleware.RequestIdMiddleware", *MIDDLEWARE]
# Where the gateway caches each model's tokenizer.json (attached to its row or fetched from
# its upstream).
ACS_TOKENIZER_CACHE_DIR = env("ACS_TOKENIZER_CACHE_DIR", str(BASE_DIR / ".run" / "tokenizers"))

# Celery's Django fixup closes a prefork worker's whole database pool after every task (a
# new PostgreSQL connection per task, on the playground's path to the first token); with
# this set it does so every N tasks only. The connection itself still goes back to the pool,
# and is checked when taken again, around every task (acs_portal/celery.py).
CELERY_DB_REUSE_MAX = env_int("CELERY_DB_REUSE_MAX", 100, minimum=0)

# --- ASGI split (acs_portal/asgi.py) ---
# The /v1 gateway's own middleware chain: async-native only, no session/CSRF/auth.
GATEWAY_MIDDLEWARE = ["api.middleware.RequestIdMiddleware"]
# A request body (/v1 and the portal's) must arrive within this many seconds, else 408 (on /v1
# request_timeout; 8 MiB at 2.5 Mbit/s): a client trickling bytes cannot hold a connection
# open for long.
ACS_REQUEST_BODY_TIMEOUT_SECONDS = env_int("ACS_REQUEST_BODY_TIMEOUT_SECONDS", 30, minimum=1)

# --- Playground live output (playground/runs/streams.py) ---
# Seconds of silence on a run's SSE stream after which a `: keepalive` comment is sent (also
# how long one blocking Redis read waits; its socket timeout is longer).
PLAYGROUND_SSE_KEEPALIVE_SECONDS = env_int("PLAYGROUND_SSE_KEEPALIVE_SECONDS", 15, minimum=1)

# --- Deployment (docs/deploy.md) ---
# The beat sweep frees budget holds and leases not marked alive for this long: anything older
# belongs to a process that died. A running stream marks its hold alive six times in this
# span (metering.gateway.hold_heartbeat_s); a non-streaming request, completion job or
# harvest batch does not, and runs for at most 14 minutes (api/upstream.py,
# NON_STREAMING_TIMEOUT_S). A shorter age would free the hold of a request still running and
# let other requests spend the same budget: refused.
ACS_STALE_RESERVATION_MIN_SECONDS = 15 * 60
ACS_STALE_RESERVATION_SECONDS = env_int(
    "ACS_STALE_RESERVATION_SECONDS",
    30 * 60,
    minimum=ACS_STALE_RESERVATION_MIN_SECONDS,
    why="a non-streaming request holds its budget for up to 14 minutes without marking it alive",
)

# --- Engine surface (issue 12.9) ---
# When set, `python -m engine serve` requires `Authorization: Bearer <this>` and the gateway
# sends it to every upstream (vLLM's --api-key takes the same header). Same variable for both.
ACS_ENGINE_TOKEN = env("ACS_ENGINE_TOKEN", "")

# --- Login throttling (issues 12.10, 20.7 and 36.7, accounts/login_throttle.py) ---
# Wrong passwords within ACS_LOGIN_LOCKOUT_SECONDS of the first, counted in PostgreSQL: this
# many for one account from one IP address lock that pair for ACS_LOGIN_LOCKOUT_SECONDS;
ACS_LOGIN_FAILURE_LIMIT = env_int("ACS_LOGIN_FAILURE_LIMIT", 5, minimum=1)
ACS_LOGIN_LOCKOUT_SECONDS = env_int("ACS_LOGIN_LOCKOUT_SECONDS", 15 * 60, minimum=1)
# this many for one account from addresses it has not signed in from lock the account at
# every such address, for the lockout and twice as long at each further lock, up to
# ACS_LOGIN_LOCKOUT_MAX_SECONDS; an address the account signed in from with the right
# password within ACS_LOGIN_KNOWN_ADDRESS_SECONDS is exempt (so whoever knows an e-mail
# address cannot lock its owner out), and its wrong passwords are not counted for the account;
ACS_LOGIN_ACCOUNT_FAILURE_LIMIT = env_int("ACS_LOGIN_ACCOUNT_FAILURE_LIMIT", 20, minimum=1)
ACS_LOGIN_LOCKOUT_MAX_SECONDS = env_int("ACS_LOGIN_LOCKOUT_MAX_SECONDS", 24 * 3600, minimum=1)
ACS_LOGIN_KNOWN_ADDRESS_SECONDS = env_int(
    "ACS_LOGIN_KNOWN_ADDRESS_SECONDS", 90 * 24 * 3600, minimum=1
)
# and this many from one address over any accounts lock that address for the lockout.
ACS_LOGIN_ADDRESS_FAILURE_LIMIT = env_int("ACS_LOGIN_ADDRESS_FAILURE_LIMIT", 50, minimum=1)
# Staff's second factor (issue 43.2, accounts/access.py): its codes count in the throttle
# above, as wrong passwords do; django-otp's own back-off per device (unaudited, and it
# refuses a right code typed within seconds of a wrong one) is off.
OTP_TOTP_THROTTLE_FACTOR = 0
OTP_STATIC_THROTTLE_FACTOR = 0
# The name authenticator apps show beside the account.
OTP_TOTP_ISSUER = "ACS Portal"
CELERY_BEAT_SCHEDULE["accounts.login_throttles_prune"] = {
    "task": "accounts.tasks.login_throttles_prune_task",
    "schedule": 3600.0,
}

# --- Harvest jobs: retention and size (issue 12.3) ---
# A harvest job's files are deleted (the job then reads as expired) this long after it ends.
ACS_HARVEST_RETENTION_SECONDS = env_int("ACS_HARVEST_RETENTION_SECONDS", 7 * 24 * 3600, minimum=0)
# The most bytes one harvest job may write (checked at submission, enforced per batch).
ACS_HARVEST_MAX_JOB_BYTES = env_int("ACS_HARVEST_MAX_JOB_BYTES", 2 * 1024**3, minimum=1)

# --- Reliability (issue #12: the fault suite in tests/faults) ---
# A pooled connection that PostgreSQL ended (a restart, a failover, pg_terminate_backend) is
# checked when a request, task or gateway worker-thread call takes it from the pool, and
# replaced, instead of failing that call with a 500.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
