"""Personal data and secrets (rlpipe.data.pii): each kind found where it is, and near-misses that must not fire.

Most cases are taken from public detectors' own test suites (cited per block, repository and path at the
commit read: presidio 0aa9f8e, detect-secrets 5e14193, gitleaks b58d3f1); the test code is ours. Where
rlpipe decides differently from the source, the case says so and why.
"""

from __future__ import annotations

import pytest

from rlpipe.data.pii import KINDS, find_pii, luhn, mask, redact

# (kind, text, the text the finding must cover)
POSITIVES: list[tuple[str, str, str]] = []
# (kind the near-miss resembles, text): nothing at all may be found in it
NEAR_MISSES: list[tuple[str, str]] = []


def pos(kind: str, *cases: str | tuple[str, str]) -> None:
    for c in cases:
        text, span = (c, c) if isinstance(c, str) else c
        POSITIVES.append((kind, text, span))


def near(kind: str, *texts: str) -> None:
    NEAR_MISSES.extend((kind, t) for t in texts)


# --- email -------------------------------------------------------------------------------------
# microsoft/presidio: presidio-analyzer/tests/test_email_recognizer.py
pos("email", "info@presidio.site", ("my email address is info@presidio.site", "info@presidio.site"),
    ("try one of these emails: info@presidio.site", "info@presidio.site"), "user@xn--80ak6aa92e.com",
    "a@xn--d1acufc.xn--p1ai", ("my email is user@xn--80ak6aa92e.com today", "user@xn--80ak6aa92e.com"))
near("email", "my email is info@presidio.", "this is not an email: hello-world here")
# gitleaks/gitleaks: cmd/generate/config/rules/generic.go (an fp of the *generic secret* rule: an e-mail, not a secret)
pos("email", ('author = "james.fake@ymail.com",', "james.fake@ymail.com"))
# Yelp/detect-secrets: tests/plugins/ip_public_test.py (an IP detector's near-miss; a service mailbox, nobody's
# personal address, so no email finding either)
near("email", "noreply@github.com")
# rlpipe's own: addresses of nobody — RFC 2606 documentation domains and git remotes — that fill code data
near("email", "git@github.com:owner/repo.git", "user@example.com", "alice@mail.example.org", "postmaster@uni-bonn.de")
# rlpipe's own: code with the matmul operator, decorators, and a domain without a top-level domain
near("email", "y = W@x.transpose(0, 1)", "z = q@k.T", "@property\ndef name(self):", "x = a@b.c", "local@localhost")

# --- phone -------------------------------------------------------------------------------------
# microsoft/presidio: presidio-analyzer/tests/test_phone_recognizer.py
pos("phone", ("My US number is (415) 555-0132", "(415) 555-0132"),
    ("my international one is +1 415 555 0132", "+1 415 555 0132"),
    ("My Israeli number is 09-7625400", "09-7625400"), ("_: (415)555-0132", "(415)555-0132"),
    ("US: 415-555-0132", "415-555-0132"), ("Brazil: +55 11 98456 5666", "+55 11 98456 5666"),
    ("My Japanese number is 090-1234-5678", "090-1234-5678"), ("one is +44 (20) 7123 4567", "+44 (20) 7123 4567"),
    ("one is +91 4155550132", "+91 4155550132"), ("one is +49 30 1234567", "+49 30 1234567"),
    ("one is +39 06 678 4343", "+39 06 678 4343"), ("one is +30 21 0 1234567", "+30 21 0 1234567"),
    ("one is +33 1 42 68 53 00", "+33 1 42 68 53 00"))
# rlpipe's own: UK and DE national formats (Ofcom drama numbers 01632 96xxxx, 07700 900xxx; DE area codes)
pos("phone", ("call 020 7123 4567", "020 7123 4567"), ("ring 01632 960001", "01632 960001"),
    ("mobile 07700 900123.", "07700 900123"), ("Tel. 030 1234567", "030 1234567"), ("Tel: 089/12345678", "089/12345678"),
    ("Handy 0171 1234567", "0171 1234567"), ("WhatsApp +4915112345678.", "+4915112345678"), ("Tel. (030) 1234567", "(030) 1234567"), "1-800-555-0199")
# presidio's CN case "13812345678" is a bare digit run: rlpipe never reads one as a phone number (see near-misses)
near("phone", "My CN number is 13812345678", "12+34=46", "3.14159", "2023-10-05", "05/10/2023", "1,234,567",
     "ISBN 978-0-306-40615-7", "ISBN 0-306-40615-2", "x = 415-555-0132", "415-555-0132 = -272", "5 +44 20 7123 4567",
     "Sort: 512 384 1024", "a gain of +15000000 over the year", "x = +4915112345678", "call 5551234", "Compute 1234567890 / 7", "n+1 415 555 0132", "x^2 +12 345 6789")

# --- US SSN ------------------------------------------------------------------------------------
# microsoft/presidio: presidio-analyzer/tests/test_us_ssn_recognizer.py
pos("us_ssn", "078-05-1123", "078 05 1123", ("abc 078 05 1123 abc", "078 05 1123"))
# presidio scores bare and dotted forms low ("078051121", "078.05.1123", "078-051121"); rlpipe leaves them out:
# a bare 9-digit run, or dots, is far more often a number or a version in math/code data.
near("us_ssn", "078051121", "078.05.1123", "078-051121 07805-1121", "0780511201", "078051120", "000000000",
     "666000000", "078-05-0000", "078 00 1123", "693-09.4444")
# rlpipe's own: the never-issued ranges (SSA: area 000, 666, 900-999; group 00; serial 0000) and voided samples
near("us_ssn", "000-12-3456", "666-12-3456", "900-12-3456", "987-65-4321", "123-45-6789", "078-05-1120",
     "219-09-9999", "111-11-1111", "x = 512-34-1024")
pos("us_ssn", ("SSN: 536-22-8094.", "536-22-8094"))

# --- UK NINO -----------------------------------------------------------------------------------
# microsoft/presidio: presidio-analyzer/tests/test_uk_nino_recognizer.py
pos("uk_nino", "AA 12 34 56 B", "hh 01 02 03 d", "tw987654a", ("nino: PR 123612C", "PR 123612C"),
    ("Here is my National Insurance Number YZ 61 48 68 B", "YZ 61 48 68 B"))
near("uk_nino", "AA 12 34 56 H", "AB 12 34 56 1", "ab1234561", "FQ 00 00 00 C", "BG123612A", "nino: nt 99 88 77 a",
     "This isn't a valid national insurance number UV 98 76 54 B")

# --- IBAN --------------------------------------------------------------------------------------
# microsoft/presidio: presidio-analyzer/tests/test_iban_recognizer.py (a letter where a digit belongs, one
# character short, the last digit changed: each breaks the mod-97 check or the country's length)
pos("iban", "AL47212110090000000235698741", "AL47 2121 1009 0000 0002 3569 8741", "AD1200012030200359100100",
    "AT611904300234573201", "AZ21 NABZ 0000 0000 1370 1000 1944", "BH67BMAG00001299123456", "BE71 0961 2345 6769",
    "BR9700360305000010009795493P1", "HR12 1001 0051 8630 0016 0", "CY17002001280000001200527600",
    "FR1420041010050500013M02606", "FR14 2004 1010 0505 0001 3M02 606", "DE89370400440532013000",
    "DE89 3704 0044 0532 0130 00", "IT60X0542811101000000123456", "NL91 ABNA 0417 1643 00", "ES9121000418450200051332",
    "CH93 0076 2011 6238 5295 7", "GB29NWBK60161331926819", "GB29 NWBK 6016 1331 9268 19", "EE38 2200 2210 2014 5685",
    "FI2112345600000785", "DK50 0040 0440 1162 43", "TL380080012345678910157")
near("iban", "AL47 212A 1009 0000 0002 3569 8741", "AL47 2121 1009 0000 0002 3569 8740", "AD12000A2030200359100100",
     "AT61 1904 3002 3457 320", "AZ21NABZ00000000137010001945", "BH67BMAG00001299123457", "BE6853900754703",
     "HR12 1001 0051 8630 0016 1", "FR14 2004 1010 0505 0001 3M02 607", "DE89 3704 0044 0532 0130 01",
     "IT60 X054 2811 1010 0000 0123 457", "NL91 ABNA 0417 1643 01", "ES91 2100 0418 4502 0005 1333",
     "CH93 0076 2011 6238 5295 8", "GB29 NWBK 6016 1331 9268 10", "EE38 2200 2210  014 5686", "FI21 1234 5600 0007 86")

# --- credit cards ------------------------------------------------------------------------------
# microsoft/presidio: presidio-analyzer/tests/test_credit_card_recognizer.py
pos("credit_card", "4012888888881881", "4012-8888-8888-1881", "4012 8888 8888 1881", "122000000000003",
    ("my credit card: 122000000000003", "122000000000003"), "371449635398431", "5555555555554444", "5019717010103742",
    "30569309025904", "6011000400000000", "3528000700000000", "6759649826438453", "4111111111111111",
    "4917300800000000", "4484070000000000")
near("credit_card", "1748503543012", "4012-8888-8888-1882", "my credit card number is 4012-8888-8888-1882",
     "36168002586008", "my credit card number is 36168002586008")
# rlpipe's own: a Luhn-valid number as an operand, mixed separators, wrong grouping, one digit repeated
near("credit_card", "7123456789012342", "9123456789012348",  # Luhn-valid, but no issuer uses 7 or 9
     "4111111111111111 * 2 = 8222222222222222", "4111 1111-1111 1111", "41111 1111 1111 111",
     "0000000000000000", "x = 12345678901234567890")
pos("credit_card", ("Amex 3782 822463 10005, exp 09/27", "3782 822463 10005"),
    ("card 4111 1111 1111 1111 123", "4111 1111 1111 1111"))

# --- IP addresses ------------------------------------------------------------------------------
# microsoft/presidio: presidio-analyzer/tests/test_ip_recognizer.py (its positives in the documentation ranges
# 2001:db8::/32 and 192.0.2.0/24 moved to the routed 2a00:1450::/32 and 81.2.69.0/24: rlpipe skips documentation
# addresses, as it skips example.com; the originals are near-misses below)
pos("ip_address", ("microsoft.com 192.168.0.1", "192.168.0.1"), ("microsoft.com 684D:1111:222:3333:4444:5555:6:77",
    "684D:1111:222:3333:4444:5555:6:77"), "2345:0425:2CA1:0000:0000:0567:5673:23b5", "2345:0425:2CA1::0567:5673:23b5",
    "2400:c401::5054:ff:fe1b:b031", "fe80::1", "2a00:1450::8a2e:370:7334", "2a00:1450::1", "fe80::1%eth0",
    "A099::09C0:876A:130B", ("Connect to [2a00:1450::1]:8080", "2a00:1450::1"), ("Visit http://[2a00:1450::1]/path",
    "2a00:1450::1"), ("SSH to user@2a00:1450::1", "2a00:1450::1"), "::ffff:81.2.69.1", "::ffff:10.0.0.1",
    "64:ff9b::81.2.69.1", "0:0:0:0:0:FFFF:129.144.52.38", ("(192.168.1.1)", "192.168.1.1"), ("IP: 192.168.1.1.",
    "192.168.1.1"), ("192.168.1.1,", "192.168.1.1"), ("[2a00:1450::1]", "2a00:1450::1"), ("2a00:1450::1.", "2a00:1450::1"),
    ("192.168.2.1@eth0", "192.168.2.1"), ("Primary: 10.0.0.1, Secondary", "10.0.0.1"))
near("ip_address", "my ip: 192.168.0", "684D:1111:222:3333:4444:5555:77", "::ffff:256.0.0.1", "::ffff:192.168.1",
     "2001:db8::256.1.1.1", "MAC address aa:bb:cc:dd:ee:ff", "Time 12:34:56", "Ratio 1:2:3:4", "CSS color #ff00aa",
     "Version 1.2.3", "Port 80:443", "abc:def:ghi", "123:abc", "file:///path/to/file", "std::cout", "MyClass::toString",
     ":::", "IP192.168.1.1text", "text192.168.1.1", "fe80::1text", "text2001:db8::1", "256.256.256.256",
     "192.168.1.256", "gggg:hhhh::1234", "192.168.1", "300.168.1.1", "12345:db8::1", "2001::db8::1", "2001::25de::cade")
# presidio finds "192.168.1.1" in "192.168.1.1.1" and matches "::1" and "::": rlpipe does not — a longer dotted run
# is a version or an OID, and loopback/unspecified addresses identify nobody (they fill every code sample).
near("ip_address", "192.168.1.1.1", "my ip: ::1", "Use local ipv6 ::")
# Yelp/detect-secrets: tests/plugins/ip_public_test.py
pos("ip_address", "133.133.133.133", ("This line has an IP address 133.133.133.133@something else", "133.133.133.133"),
    ("133.133.133.133:8080", "133.133.133.133"), "1.1.1.1")
near("ip_address", "127.0.0.1", "169.254.169.254", "256.256.256.256", "1.2.3", "1.2.3.4.5.6", "1.2.3.4.5.6.7.8",
     "1.2.3.04", "github.com")
# detect-secrets does not flag private ranges (10/8, 172.16/12, 192.168/16); rlpipe does, as presidio does: a
# private address still tells where a trajectory's text came from.
pos("ip_address", "10.0.0.1", "172.16.0.1")
# rlpipe's own: a word that ends like "ver" or "no" before an address does not hide it
pos("ip_address", ("ssh to server 81.2.69.160", "81.2.69.160"), ("piano 8.8.4.4", "8.8.4.4"))
# presidio's documentation-range positives, and RFC 5737's other two ranges: addresses of nobody
near("ip_address", "2001:db8::1", "Connect to [2001:db8::1]:8080", "::ffff:192.0.2.1", "192.0.2.1", "198.51.100.7",
     "203.0.113.9", "2001:db8::8a2e:370:7334")
# rlpipe's own: versions, section numbers, numpy slices and ratios
near("ip_address", "version 1.2.3.4", "Section 10.2.3.4", "v1.2.3.4", "a[1::2]", "a[::2]", "x[::-1]", "1.2.10",
     "0.0.0.0", "cafe::feed", "impl dead::beef for X", "netmask 255.255.255.0", "mDNS 224.0.0.251", "ff02::1",
     'According to the HTML5 specs sections "8.2.4.44 Bogus comment state"', "IPv4Network('100.64.0.0/10')",
     "allow from 10.0.0.0/8;", "IPv6Network('2001:10::/28')")
pos("ip_address", ("inet 192.168.1.17/24 brd 192.168.1.255", "192.168.1.17"))  # an interface's address, with its mask

# --- AWS ---------------------------------------------------------------------------------------
# Yelp/detect-secrets: tests/plugins/aws_key_test.py
near("aws_access_key", "akiazzzzzzzzzzzzzzzz", "AKIAZZZ")
# detect-secrets flags AKIAZZZZZZZZZZZZZZZZ / A3T0ZZZ...; rlpipe follows gitleaks' entropy floor: a placeholder
near("aws_access_key", "AKIAZZZZZZZZZZZZZZZZ", "A3T0ZZZZZZZZZZZZZZZZ")
# gitleaks/gitleaks: cmd/generate/config/rules/aws.go
pos("aws_access_key", "AKIALALEMEL33243OLIB", ("aws_access_key_id = ASIAY34FZKBOKMUTVV7A", "ASIAY34FZKBOKMUTVV7A"),
    "ABIAXYZ5BQ7R2MLN4KJP", "ACCAQ6TRS3VWX7YZ2MLB")
near("aws_access_key", "key = AKIAXXXXXXXXXXXXXXXX", "aws_access_key: AKIAIOSFODNN7EXAMPLE",
     'msgstr "Näytä asiakirjamallikansio."', "TODAYINASIAASACKOFRICEFELLOVER")
# detect-secrets: a 40-character secret in an assignment is a key, 39 or 41 characters are not (their value is
# AWS's documented EXAMPLEKEY, which rlpipe — like gitleaks — takes for the placeholder it is; same shape here)
SECRET40 = "Xu3TkPfX1Qv9Lm2Rb8Zs0Yc7Wd4Ne6Ga5Hj/Ko+T"
pos("aws_secret_key", (f'aws_access_key = "{SECRET40}"', SECRET40), (f"AWS_SECRET_ACCESS_KEY={SECRET40}", SECRET40),
    (f"aws_secret_access_key: '{SECRET40}'", SECRET40))
near("aws_secret_key", 'aws_access_key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"',
     'aws_secret_access_key = os.environ["AWS_SECRET"]')
# ... and 39 or 41 characters are no AWS secret key (the generic rule still reports such a value as a secret)
WRONG_LENGTH = [f'aws_access_key = "{SECRET40}a"', f'aws_access_key = "{SECRET40[:39]}"']

# --- GitHub ------------------------------------------------------------------------------------
# Yelp/detect-secrets: tests/plugins/github_token_test.py; gitleaks: cmd/generate/config/rules/github.go
pos("github_token", "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", "gho_16C7e42F292c6912E7710c838347Ae178B4a",
    ("token: ghs_aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5", "ghs_aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5"),
    "github_pat_11ABCDEFG0123456789abc_aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5zA7bC9dE1fG3hI5jK7lM9nO")
near("github_token", "foo_wWPw5k4aXcaT4fNP0UcnZwJUVFk6LO0pINUx", "foo", "ghp_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
     "gho_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
     "github_pat_xxxxxxxxxxxxxxxxxxxxxx_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
     "ghp_wWPw5k4aXcaT4fNP0UcnZwJUVFk6LO0pINU")  # one short

# --- Slack -------------------------------------------------------------------------------------
# Yelp/detect-secrets: tests/plugins/slack_test.py
pos("slack_token", "xoxp-523423-234243-234233-e039d02840a0b9379c", "xoxo-523423-234243-234233-e039d02840a0b9379c",
    "xoxs-523423-234243-234233-e039d02840a0b9379c", "xoxa-511111111-31111111111-3111111111111-e039d02840a0b9379c",
    "xoxa-2-511111111-31111111111-3111111111111-e039d02840a0b9379c", "xoxr-523423-234243-234233-e039d02840a0b9379c",
    "xoxb-34532454-e039d02840a0b9379c")
# detect-secrets' webhook case is all x placeholders ("Txxxxxxxx/Bxxxxxxxx/xxx..."): a near-miss here
near("slack_token", "https://hooks.slack.com/services/Txxxxxxxx/Bxxxxxxxx/xxxxxxxxxxxxxxxxxxxxxxxx")
pos("slack_token", "https://hooks.slack.com/services/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")
# gitleaks/gitleaks: cmd/generate/config/rules/slack.go
pos("slack_token", ('"bot_token1": "xoxb-781236542736-2364535789652-GkwFDQoHqzXDVsC6GzqYUypD"',
                    "xoxb-781236542736-2364535789652-GkwFDQoHqzXDVsC6GzqYUypD"),
    ('"user_token2": "xoxp-283316862324-298911817009-298923149681-44f585044dace54f5701618e97cd1c0b"',
     "xoxp-283316862324-298911817009-298923149681-44f585044dace54f5701618e97cd1c0b"))
near("slack_token", "xoxb-xxxxxxxxx-xxxxxxxxxx-xxxxxxxxxxxx", "xoxb-xxx", "xoxb-12345-abcd234", "xoxb-xoxb-my-bot-token",
     '"token1": "xoxp-1234567890"', '"token2": "xoxp-XXXXXXXXXX-XXXXXXXXXX-XXXXXXXXXXX-XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"',
     '"token3": "xoxp-1234-1234-1234-4ddbc191d40ee098cbaae6f3523ada2d"',
     '"token4": "xoxp-572370529330-573807301142-572331691188-####################"',
     "https://docs.google.com/document/d/1W7KCxOxP-1Fy5EyF2lbJGE2WuKmu5v0suYqoHas1jRM")

# --- OpenAI / Anthropic ------------------------------------------------------------------------
# Yelp/detect-secrets: tests/plugins/openai_test.py
pos("openai_key", "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",
    "sk-proj-Xi8tdMjHV6pmbBbwilTeT3BlbkFJ3UDnpdEwNNm6wVBpYM0o")
near("openai_key", "sk-proj-Xi8tdMjHV6pmbBbwilTeT4BlbkFJ3UDnpdEwNNm6wVBpYM0o")
# gitleaks/gitleaks: cmd/generate/config/rules/openai.go
pos("openai_key",
    "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",
    "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",
    "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")
# gitleaks/gitleaks: cmd/generate/config/rules/anthropic.go
pos("anthropic_key",
    "sk-ant-api03-abc123xyz-456def789ghij-klmnopqrstuvwx-3456yza789bcde-1234fghijklmnopby56aaaogaopaaaabc123xyzAA",
    "sk-ant-admin01-abc12fake-456def789ghij-klmnopqrstuvwx-3456yza789bcde-12fakehijklmnopby56aaaogaopaaaabc123xyzAA")
near("anthropic_key", "sk-ant-api03-abc123xyz-456de-klMnopqrstuvwx-3456yza789bcde-1234fghijklmnopAA",
     "sk-ant-api03-abc123xyz-456def789ghij-klmnopqrstuvwx-3456yza789bcde-1234fghijklmnopby56aaaogaopaaaabc123xyzBB")
# rlpipe's own: scikit-learn and other sk- words
near("openai_key", "pip install sk-learn", "the sk-means of x", "sk-1234")

# --- Google API key ----------------------------------------------------------------------------
# gitleaks/gitleaks: cmd/generate/config/rules/gcp.go (gitleaks also allows a list of published keys; rlpipe
# finds those: they are keys all the same)
pos("google_api_key", "AIzaSyNHxIf32IQ1a1yjl3ZJIqKZqzLAK1XhDk-", "AIzaSyA8vmApnrHNFE0bApF4hoZ11srVL_n0nvY")
near("google_api_key",
     "GWw4hjABFzZCGiRpmlDyDdo87Jn9BN9THUA47muVRNunLxsa82tMAdvmrhOqNkRKiYMEAFbTJAIzaTesb6Tscfcni8vIpWZqNCXFDFslJtVSvFDq",
     "AIzaTesb6Tscfcni8vIpWZqNCXFDFslJtVSvFDqabcd123", 'apiKey: "AIzaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"',
     "AIZASYCO2CXRMC9ELSKLHLHRMBSWDEVEDZTLO2O")

# --- Hugging Face token ------------------------------------------------------------------------
# gitleaks/gitleaks: cmd/generate/config/rules/huggingface.go
pos("huggingface_token", ("huggingface-cli login --token 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",
                          "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"),
    ('-H "Authorization: Bearer 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"', "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"),
    ("DEV=1 HF_TOKEN=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 poetry run python app.py", "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"),
    ("use_auth_token='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')", "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"),
    ('CI_HUB_USER_TOKEN = "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"', "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"))
near("huggingface_token", "- (id)hf_requiredCharacteristicTypesForDisplayMetadata;",
     'amazon.de#@#div[data-cel-widget="desktop-rhf_SponsoredProductsRemoteRHFSearchEXPSubsK2ClickPagination"]',
     "                            _kHMSymptomhf_generatedByHomeAppForDebuggingPurposesKey,",
     "  M_UINT       (ServingCellPriorityParametersDescription_t,  H_PRIO,  2, &hf_servingcellpriorityparametersdescription_h_prio),",
     'os.environ.get("HF_AUTH_TOKEN",\n"hf_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"),',
     "HUGGINGFACE_API_TOKEN=hf_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx,")

# --- JWT ---------------------------------------------------------------------------------------
# Yelp/detect-secrets: tests/plugins/jwt_test.py
pos("jwt",
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
    "eyJ0eXAiOiJKV1QiLA0KImFsZyI6IkhTMjU2In0.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ",
    "eyJ0eXAiOiJKV1QiLCJhbGciOiJIUzI1NiJ9.eyJuYW1lIjoiSm9lIiwKInN0YXR1cyI6ImVtcGxveWVlIgp9",
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IsWww6HFkcOtIMOWxZHDqcOoIiwiaWF0IjoxNTE2MjM5MDIyfQ.k5HibI_uLn_RTuPcaCNkaVaQH2y5q6GvJg8GPpGMRwQ")
near("jwt", '{"alg":"HS256","typ":"JWT"}.{"name":"Jon Doe"}.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c',
     "bm90X3ZhbGlkX2pzb25fYXRfYWxs.bm90X3ZhbGlkX2pzb25fYXRfYWxs.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
     "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9", "jwt",
     "eyJhbasdGciOiJIUaddasdasfsasdasdzI1NiIasdsInR5cCI6IkpXVCasdJasd9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
     "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
     "eyJAAAA.eyJBBB", "eyJBB.eyJCC.eyJDDDD")
# gitleaks/gitleaks: cmd/generate/config/rules/jwt.go
pos("jwt", ('String tokenWithNoneAlg = "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ0ZXN0LXVzZXIifQ.";',
            "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ0ZXN0LXVzZXIifQ."),
    ('"Authorization": "Bearer eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJ1c2VybmFtZTpib2IifQ.HcfCW67Uda-0gz54ZWTqmtgJnZeNem0Q757eTa9EZuw"',
     "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJ1c2VybmFtZTpib2IifQ.HcfCW67Uda-0gz54ZWTqmtgJnZeNem0Q757eTa9EZuw"))

# --- PEM private keys --------------------------------------------------------------------------
# gitleaks/gitleaks: cmd/generate/config/rules/privatekey.go
PKCS8 = ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQDAC4AWkdwKYSd8\n"
         "Ks14IReLcYgADhoXk56ZzXI=\n-----END PRIVATE KEY-----")
RSA = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEpQIBAAKCAQEAn6/O8li+SX4m98LLYt/PKSzEmQ++ZBD7Loh9P13f4yQ92EF3\n"
       "yxR5MsXFu9PRsrYQA7/4UTPHiC4y2sAVCBg4C2yyBpUEtMQjyCESi6Y=\n-----END RSA PRIVATE KEY-----")
PGP = ("-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQWGBGSVV4YBDAClvRnxezIRy2Yv7SFlzC0iFiRF/O/jePSw+XYhvcrTaqSYTGic\n"
       "=8xQN\n-----END PGP PRIVATE KEY BLOCK-----")
pos("private_key", PKCS8, (f"key file:\n{RSA}\n", RSA), PGP)
near("private_key", "-----BEGIN PRIVATE KEY-----\nanything\n-----END PRIVATE KEY-----",
     "-----BEGIN OPENSSH PRIVATE KEY----------END OPENSSH PRIVATE KEY-----")
# Yelp/detect-secrets: tests/plugins/private_key_test.py flags a BEGIN line over any body ("super secret private
# key here", "yabba dabba doo"); rlpipe follows gitleaks (64+ base64 characters): prose about keys is no key
near("private_key", "-----BEGIN RSA PRIVATE KEY-----\nsuper secret private key here\n-----END RSA PRIVATE KEY-----",
     "some text here\n-----BEGIN PRIVATE KEY-----\nyabba dabba doo")
# rlpipe's own: a block cut short (no END line), and one inside JSON (escaped newlines)
CUT = RSA.rsplit("\n", 1)[0]
pos("private_key", (CUT + "\nand then the text goes on", CUT),
    ('{"key": "' + RSA.replace("\n", "\\n") + '"}', RSA.replace("\n", "\\n")))
near("private_key", "-----BEGIN PUBLIC KEY-----\nMIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEAn6/O8li+SX4m98LLYt/PK\n-----END PUBLIC KEY-----")

# --- generic secret assignments ----------------------------------------------------------------
# Yelp/detect-secrets: tests/plugins/keyword_test.py (the assignment forms; their deliberately odd secret value
# contains "${" and "<", which rlpipe reads as a template placeholder, so a plain random value stands in)
VALUE = "Zf3D0LXCM3EIMbgJpUNnkRtOfOueHznB"
pos("secret", *[(form.format(VALUE), VALUE) for form in (
    'password = "{}"', "apikey = {}", "api_key: '{}'", "db_pass: {},", "passwd: {}`", "private_key: {}\"",
    "secret: {}'", 'if (apikey == "{}") {{', 'if (api_key != "{}") {{', 'apikey := "{}"', "api_key := '{}'",
    "aws_secret_access_key := `{}`", "db_pass := {}", 'password = @"{}";', "DB_PASSWORD={}")])
near("secret", 'password = ",.:-¨@*¿?!"', 'api_key = ""', "secret: ''", 'password = "somefakekey"', "password: ${link}",
     'some_key = "real_secret"', "private_key \"hopenobodyfindsthisone';", "password: real_key")
# gitleaks/gitleaks: cmd/generate/config/rules/generic.go
pos("secret", ("'access_token': 'eyJ0eXAioiJKV1slS3oASx=='", "eyJ0eXAioiJKV1slS3oASx=="),
    ('"credentials" : "0afae57f3ccfd9d7f5767067bc48b30f719e271ba470488056e37ab35d4b6506"',
     "0afae57f3ccfd9d7f5767067bc48b30f719e271ba470488056e37ab35d4b6506"),
    ('"client_secret" : "6da89121079f83b2eb6acccf8219ea982c3d79bccc3e9c6a85856480661f8fde",',
     "6da89121079f83b2eb6acccf8219ea982c3d79bccc3e9c6a85856480661f8fde"),
    ("passwd = 4kR7-vN2q.Lx9_Tb3=Wm6Ys8Zc1Hd5Fg0", "4kR7-vN2q.Lx9_Tb3=Wm6Ys8Zc1Hd5Fg0"))
near("secret", '"accessor":"rA1wk0Y45YCufyfq",', "report_access_id: e8e4df51-2054-49b0-ab1c-516ac95c691d",
     'this.ultraPictureBox1.Name = "ultraPictureBox1";', "apiUrl=apigee.corpint.com",
     "credentialsId: 'ff083f76-7804-4ef1-80e4-fe975bb9141b'", '  "credentialId": "B9mTcFSck2LzJO2S3ols63",',
     'CREDENTIALS_ID = "K8S_CRED"', 'public_key = "9Cnzj4p4WGeKLs1Pt8QuKUpRKfFLfRYC9AIKjbJTWit"',
     "primaryKey=Ab3dE5fG7hI9jK1lM3nO5pQ7rS9tU1", "password combination.\n\nR5: Regulatory--21", "PuttyPassword=0",
     'LLM_SECRET_NAME = "NEXUS-GPT4-API-KEY"', "secret_length = X25519.secret_length",
     "secretSize must be >= XXH3_SECRET_SIZE_MIN", "    access_token_url='https://github.com/login/oauth/access_token',",
     'publicToken = "9Cnzj4p4WGeKLs1Pt8QuKUpRKfFLfRYC9AIKjbJTWit"', 'clientId = "73082700-1f09-405b-80d0-3131bfd6272d"',
     "GITHUB_API_KEY=\nDYNATRACE_API_KEY=", "snowflake.password=\njdbc.snowflake.url=",
     'SRCREV_moby = "43fc912ef59a83054ea7f6706df4d53a7dea4d80"')
# rlpipe's own: Python that handles secrets without containing one
near("secret", "password = input()", 'api_key = os.environ["KEY"]', 'password=""', 'password = getpass.getpass("Password: ")',
     'password = request.form["password"]', "password: str", "password: Optional[str] = None", "self.password = password",
     "password=hashed_password", "secret_key = settings.SECRET_KEY", 'password = "changeme"', 'password = "<your password>"',
     "api_key = get_api_key(config)", 'token = tokenizer.decode(ids)', 'pad_token = "<|endoftext|>"', "pwd = os.getcwd()",
     "bypass = compute(x)", 'password = "********"', "api_key = None", 'secret = "..."',
     'client.login(username="admin", password="password")', 'password = "password123"', "DB_PASSWORD=admin1234",
     "password: 12345678", "password = Hunter2Secret(x)", "api_key = Fetch9Key[0]")

# --- maths and code that must stay clean (the data this runs on) ---------------------------------
near("*", "12+34=46", "3.14159265358979", "What is 1234567 + 7654321? The answer is 8888888.", "2023-10-05T12:34:56Z",
     "ISBN 978-3-16-148410-0", "pip install torch==2.4.1", "numpy 1.26.4, python 3.11.9", "version 1.2.10",
     "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     "commit 8d7f281a0c2e1b9f4d3e5a6b7c8d9e0f1a2b3c4d", "id = 550e8400-e29b-41d4-a716-446655440000",
     "x = np.arange(12).reshape(3, 4)[::2, 1::2]", "f(x) = 3x^2 + 2x + 1", "1/3 = 0.333...", "2^64 = 18446744073709551616",
     "Let n = 1000000007 (a prime).", "Answer: \\boxed{42}", "#### 1,000", "12:30 pm on 05.10.2023", "$5,250.00",
     "0.0.0.0:8000", "http://localhost:8080/v1/completions", "127.0.0.1", "The ratio is 3:4:5.")


def _found(text: str) -> list[tuple[str, str]]:
    return [(f.kind, f.text) for f in find_pii(text)]


@pytest.mark.parametrize("kind,text,span", POSITIVES, ids=[f"{k}:{t[:40]}" for k, t, _ in POSITIVES])
def test_finds(kind, text, span):
    assert (kind, span) in _found(text)


@pytest.mark.parametrize("kind,text", NEAR_MISSES, ids=[f"{k}:{t[:40]}" for k, t in NEAR_MISSES])
def test_near_miss_does_not_fire(kind, text):
    assert _found(text) == []


def test_every_kind_has_positives_and_near_misses():
    for kind in KINDS:
        assert any(k == kind for k, _, _ in POSITIVES), kind
        assert any(k == kind for k, _ in NEAR_MISSES), kind


def test_redact_puts_typed_placeholders():
    text = "Mail jane.doe@uni-bonn.de or call +44 20 7123 4567; key AKIALALEMEL33243OLIB, password = \"s3cr3tP4ss!\"."
    assert redact(text) == ("Mail [EMAIL] or call [PHONE]; key [AWS_ACCESS_KEY], password = \"[SECRET]\".")
    assert redact("12+34=46, nothing here") == "12+34=46, nothing here"


def test_findings_carry_positions_and_mask():
    text = "contact: jane.doe@uni-bonn.de"
    [f] = find_pii(text)
    assert (f.kind, text[f.start : f.end], f.placeholder) == ("email", "jane.doe@uni-bonn.de", "[EMAIL]")
    assert "jane.doe@uni-bonn.de" not in str(f.to_dict()) and f.to_dict()["masked"].startswith("jane")
    assert mask("AKIALALEMEL33243OLIB") == "AKIA…(20 chars)" and mask("078-05-1123") == "07…(11 chars)"


def test_more_specific_kind_wins_an_overlap():
    # an AWS secret in an assignment is one aws_secret_key finding, not also a generic secret
    assert _found(f"aws_secret_access_key = {SECRET40}") == [("aws_secret_key", SECRET40)]


@pytest.mark.parametrize("text", WRONG_LENGTH)
def test_aws_secret_needs_40_characters(text):
    assert [k for k, _ in _found(text)] == ["secret"]


@pytest.mark.parametrize("text", ["a." * 20000, "x-" * 20000 + "=", "+" + "1" * 80 + "a", "1234 " * 8000, "a:" * 20000,
                                  "eyJ" + "A" * 100000, "password " * 8000])
def test_time_stays_linear_on_adversarial_text(text):
    # a lazy unbounded name prefix took 100 s on the first of these; optional phone separators 0.6 s on 82 chars
    import time

    start = time.perf_counter()
    find_pii(text)
    assert time.perf_counter() - start < 5


def test_luhn():
    assert luhn("4111111111111111") and not luhn("4111111111111112")
