"""Provisioning: the local provider, the AWS Pulumi program and preflight, prices and the ledger.

Importing this package pulls in nothing heavy: `remote/` imports `infra.inventory` and `infra.ledger`,
which use only the standard library, so `fab` never loads Pulumi or boto3.
"""
