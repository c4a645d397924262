"""Client library for the ACS API: a typed httpx client (`acs_client.client`), the activation
tensor codec (`acs_client.codec`) and the loaders of activation downloads
(`acs_client.downloads`). The request and response models shared with the server are
`acs_client.protocol` and `acs_client.responses`."""

__version__ = "0.1.0"
