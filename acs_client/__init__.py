"""Client library for the ACS API: a typed httpx client (`acs_client.client`), the activation
tensor codec (`acs_client.codec`) and the loaders of activation downloads
(`acs_client.downloads`). The request schema shared with the server is `acs_client.protocol`."""

__version__ = "0.1.0"
