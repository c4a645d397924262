"""Client library for the ACS API: the tensor codec (`acs_client.codec`)."""
